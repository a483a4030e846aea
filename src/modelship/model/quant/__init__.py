"""Load-time quantization handlers, chosen from a checkpoint's `quantization_config`."""

from modelship.model.quant.base import QuantizationMethod
from modelship.model.quant.registry import (
    UnsupportedQuantizationError,
    create_quantization,
    supported_quantization_methods,
)

__all__ = [
    "QuantizationMethod",
    "UnsupportedQuantizationError",
    "create_quantization",
    "supported_quantization_methods",
]
