"""Stage 2: optimized variants (fp16, awq, gptq, ...) of a base model."""

from modelship.pipeline.optimize.runner import VariantResult, optimize, recipe_for
from modelship.pipeline.optimize.schemes import Recipe, create_scheme, supported_schemes

__all__ = [
    "Recipe",
    "VariantResult",
    "create_scheme",
    "optimize",
    "recipe_for",
    "supported_schemes",
]
