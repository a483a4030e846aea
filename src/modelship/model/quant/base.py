"""The load-time half of quantization: turn checkpoint tensors into a linear module.

A method is chosen from the checkpoint's `quantization_config` (never from file names) by
`quant.registry.create_quantization`. `load_linear` receives the checkpoint prefixes of
one or more projections that share an input (q/k/v, gate/up) and returns one module
computing all of them, outputs concatenated in prefix order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from modelship.model import cpu_kernels

TensorSource = Callable[[str], torch.Tensor]  # checkpoint name -> tensor (raises if missing)


class QuantizationMethod(Protocol):
    """Builds the linear modules of one checkpoint's storage scheme."""

    name: str

    def load_linear(
        self,
        get: TensorSource,
        prefixes: list[str],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        """One module for `prefixes` (fused along the output dim), computing in `dtype`."""
        ...


# Torch's path, where modelship's CPU kernels are unavailable (see `dense_linear`).
# Measured on a 2-core AVX2 CPU (no native bf16), [n, 576] x [576, 3072]: bf16 matmul costs
# grow linearly with n (0.23 ms at n=1, 1.7 ms at 8, 14 ms at 64, 108 ms at 512) while
# upcasting the weight and running fp32 costs 0.43, 0.91, 2.5, 11.5 ms in isolation. Inside
# the model the fresh fp32 copies cost page faults, so the detour only pays for prefill-sized
# batches (a 1x128 prefill of the demo model: 1.7 s -> 0.7 s; 8x128: 13 s -> 2.6 s).
UPCAST_MIN_ROWS = 32
_UPCAST_CHUNK_ROWS = 4096  # weight rows upcast at a time: bounds the fp32 copy (lm_head)


def bf16_upcast_rows(device: torch.device, dtype: torch.dtype) -> int | None:
    """From how many input rows bf16 matmuls should run in fp32; None: never."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return None
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX512/AMX: bf16 GEMMs are fast
        return None
    return UPCAST_MIN_ROWS


def dense_linear(
    x: torch.Tensor,  # [n, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None,
    upcast_rows: int | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [n, out] in out_dtype (default: x's dtype)
    """x W^T (+ b). On a CPU with modelship's kernels, `cpu_kernels.dense_linear`: fp32
    accumulation, each row reduced in one order whatever the number of rows (torch's bf16
    and fp32 CPU matmuls change order and path with it, and greedy tokens with the batch).
    Elsewhere torch's; with `upcast_rows` set and n >= it, computed in fp32 (see above)."""
    out_dtype = out_dtype or x.dtype
    kernel_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    if (
        x.device.type == "cpu"
        and weight.dtype in kernel_dtypes
        and weight.is_contiguous()
        and (cpu_kernels.load())
    ):
        y = cpu_kernels.dense_linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return y.view(*x.shape[:-1], -1).to(out_dtype)
    if upcast_rows is None or x.shape[0] < upcast_rows:
        return F.linear(x, weight, bias).to(out_dtype)
    x32 = x.float()
    y = torch.cat([F.linear(x32, w.float()) for w in weight.split(_UPCAST_CHUNK_ROWS)], dim=-1)
    if bias is not None:
        y = y.add_(bias)
    return y.to(out_dtype)


class DenseLinear(nn.Module):
    """y = x W^T (+ b) with W [out, in] in the compute dtype."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, upcast_rows: int | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.upcast_rows = upcast_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        return dense_linear(x, self.weight, self.bias, self.upcast_rows)


def load_bias(
    get: TensorSource, prefixes: list[str], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The concatenated `<prefix>.bias` tensors, [sum of out]."""
    return torch.cat([get(f"{p}.bias") for p in prefixes]).to(dtype=dtype, device=device)


class Unquantized:
    """Dense checkpoints (fp32/fp16/bf16 weights), cast to the compute dtype."""

    name = "none"

    def load_linear(
        self,
        get: TensorSource,
        prefixes: list[str],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        # Cast each part before concatenating: fp32 checkpoints never hold a second fp32 copy.
        parts = [get(f"{p}.weight").to(dtype=dtype, device=device) for p in prefixes]
        weight = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
        b = load_bias(get, prefixes, dtype, device) if bias else None
        return DenseLinear(weight, b, bf16_upcast_rows(device, dtype))
