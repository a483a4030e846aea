"""Optimization schemes: a literal table of named variants, each an offline job writing a folder.

A scheme is the offline half of quantization (STYLE habit 9): it writes weights plus a
config the engine's load-time handler understands. What a variant folder holds is read
from its config and manifest, never from its name.
"""

from __future__ import annotations

from modelship.pipeline.errors import PipelineError
from modelship.pipeline.optimize.cast import FP16
from modelship.pipeline.optimize.llmcompressor_schemes import AWQ, GPTQ
from modelship.pipeline.optimize.recipe import Recipe, Scheme

__all__ = ["SCHEMES", "Recipe", "Scheme", "create_scheme", "supported_schemes"]

SCHEMES: dict[str, Scheme] = {scheme.name: scheme for scheme in (FP16, AWQ, GPTQ)}


def create_scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise PipelineError(
            f"unknown optimization scheme {name!r}; supported: {', '.join(sorted(SCHEMES))}"
        )
    return SCHEMES[name]


def supported_schemes() -> list[str]:
    return sorted(SCHEMES)
