"""The `fp16` variant: the base weights cast to half precision (no calibration)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modelship.pipeline.optimize.recipe import Recipe, Scheme
from modelship.pipeline.optimize.weights import cast_checkpoint, copy_tokenizer_files


def run_cast(recipe: Recipe, base_dir: Path, out_dir: Path) -> dict[str, Any]:
    cast_checkpoint(base_dir, out_dir, recipe.dtype)
    copy_tokenizer_files(base_dir, out_dir)
    return {"dtype": recipe.dtype}


FP16 = Scheme(
    name="fp16",
    description="weights cast to float16",
    default_recipe=Recipe(scheme="fp16", dtype="float16"),
    run=run_cast,
)
