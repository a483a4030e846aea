"""What a scheme is: a `Recipe` (its settings, hashed for memoization) and a `Scheme` (a
name, a default recipe and the job writing a variant folder). A leaf: the scheme modules
and the registry both import it, and it imports nothing of theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Recipe:
    """Everything that changes a scheme's output; hashed for memoization."""

    scheme: str
    dtype: str = "float16"
    bits: int | None = None
    group_size: int | None = None
    symmetric: bool | None = None
    num_calibration_samples: int = 0
    max_seq_length: int = 0
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SchemeRun = Callable[[Recipe, Path, Path], dict[str, Any]]


@dataclass(frozen=True)
class Scheme:
    name: str
    description: str
    default_recipe: Recipe
    run: SchemeRun  # (recipe, base_dir, out_dir) -> facts for the manifest
