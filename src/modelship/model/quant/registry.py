"""Quantization methods keyed on `quantization_config.quant_method`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from modelship.model.quant.base import QuantizationMethod, Unquantized
from modelship.model.quant.compressed_tensors import CompressedTensorsW4A16


class UnsupportedQuantizationError(ValueError):
    """The checkpoint's quantization is not one we can load; the message lists ours."""


_METHODS: dict[str, Callable[[dict[str, Any], str], QuantizationMethod]] = {
    "compressed-tensors": CompressedTensorsW4A16,
}


def supported_quantization_methods() -> list[str]:
    """The `quant_method` values `create_quantization` accepts, sorted."""
    return sorted(_METHODS)


def create_quantization(
    quantization_config: dict[str, Any] | None, int4_kernel: str = "auto"
) -> QuantizationMethod:
    """The load-time handler for a checkpoint's `quantization_config` (None: dense);
    `int4_kernel` picks the CPU int4 kernel (`int4.create_int4_linear`)."""
    if not quantization_config:
        return Unquantized()
    method = quantization_config.get("quant_method")
    factory = _METHODS.get(method)  # type: ignore[arg-type]
    if factory is None:
        raise UnsupportedQuantizationError(
            f"quantization method {method!r} is not supported; supported: "
            f"{', '.join(supported_quantization_methods())} (and unquantized checkpoints)"
        )
    try:
        return factory(quantization_config, int4_kernel)
    except ValueError as exc:
        raise UnsupportedQuantizationError(f"{method}: {exc}") from exc
