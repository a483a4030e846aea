"""The load-time half of quantization: turn checkpoint tensors into a linear module.

A method is chosen from the checkpoint's `quantization_config` (never from file names).
`load_linear` receives the checkpoint prefixes of one or more projections that share an
input (q/k/v, gate/up) and returns one module computing all of them, concatenated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

TensorSource = Callable[[str], torch.Tensor]  # checkpoint name -> tensor (raises if missing)


class QuantizationMethod(Protocol):
    name: str

    def load_linear(
        self,
        get: TensorSource,
        prefixes: list[str],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module: ...


class DenseLinear(nn.Module):
    """y = x W^T (+ b) with weights as stored (cast to the compute dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Unquantized:
    name = "none"

    def load_linear(self, get, prefixes, bias, dtype, device) -> nn.Module:
        weight = torch.cat([get(f"{p}.weight") for p in prefixes]).to(dtype=dtype, device=device)
        b = None
        if bias:
            b = torch.cat([get(f"{p}.bias") for p in prefixes]).to(dtype=dtype, device=device)
        return DenseLinear(weight.contiguous(), b)


def load_bias(get: TensorSource, prefixes: list[str], dtype, device) -> torch.Tensor:
    return torch.cat([get(f"{p}.bias") for p in prefixes]).to(dtype=dtype, device=device)


QuantFactory = Callable[[dict[str, Any]], QuantizationMethod]
_METHODS: dict[str, QuantFactory] = {}


def register_quantization(quant_method: str, factory: QuantFactory) -> None:
    _METHODS[quant_method] = factory


def create_quantization(quantization_config: dict[str, Any] | None) -> QuantizationMethod:
    """The load-time handler for a checkpoint's `quantization_config` (None: dense)."""
    from modelship.model.quant import compressed_tensors  # noqa: F401  (registers itself)

    if not quantization_config:
        return Unquantized()
    method = quantization_config.get("quant_method")
    if method not in _METHODS:
        raise ValueError(
            f"unsupported quantization method {method!r}; supported: "
            f"{', '.join(sorted(_METHODS))} (and unquantized checkpoints)"
        )
    return _METHODS[method](quantization_config)
