"""Optimization schemes: a registry of named variants, each an offline job writing a folder.

A scheme is the offline half of quantization (STYLE habit 9): it writes weights plus a
config the engine's load-time handler understands. What a variant folder holds is read
from its config and manifest, never from its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from modelship.pipeline.errors import PipelineError


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


_SCHEMES: dict[str, Scheme] = {}


def register_scheme(scheme: Scheme) -> None:
    _SCHEMES[scheme.name] = scheme


def create_scheme(name: str) -> Scheme:
    _load_builtin()
    if name not in _SCHEMES:
        raise PipelineError(
            f"unknown optimization scheme {name!r}; supported: {', '.join(sorted(_SCHEMES))}"
        )
    return _SCHEMES[name]


def supported_schemes() -> list[str]:
    _load_builtin()
    return sorted(_SCHEMES)


def _load_builtin() -> None:
    from modelship.pipeline.optimize import cast, llmcompressor_schemes  # noqa: F401
