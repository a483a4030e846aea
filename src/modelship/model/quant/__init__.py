"""Load-time quantization handlers, chosen from a checkpoint's `quantization_config`."""

from modelship.model.quant.base import QuantizationMethod, create_quantization

__all__ = ["QuantizationMethod", "create_quantization"]
