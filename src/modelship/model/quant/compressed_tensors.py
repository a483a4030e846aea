"""compressed-tensors `pack-quantized` W4A16 checkpoints (llm-compressor's GPTQ and AWQ).

Checkpoint layout per quantized linear (out features N, in features K, group size G):
`weight_packed` int32 [N, K/8] (eight 4-bit values per int32, element i at bits 4*(i%8),
stored as q + 8), `weight_scale` [N, K/G], `weight_shape` [2], and for asymmetric schemes
`weight_zero_point` int32 [N/8, K/G] packed along N the same way. Dequantized:
W = (q - zp) * scale, with q and zp in [-8, 7].

On CPU the weights run through torch's int4 kernel, which computes
W = (u - 8) * scale + zero for u in [0, 15]; with u = q + 8 that is zero = -zp * scale.
The kernel is fast only with bf16 activations. Elsewhere (CUDA, or shapes the kernel
does not take) the weights are dequantized once at load time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modelship.model.quant.base import (
    DenseLinear,
    TensorSource,
    Unquantized,
    load_bias,
    register_quantization,
)

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, num_columns: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, num_columns] int32 in [0, 15] (the stored q + 8)."""
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF
    return nibbles.reshape(packed.shape[0], -1)[:, :num_columns]


class Int4Linear(nn.Module):
    """A W4A16 linear on torch's CPU int4 kernel (bf16 activations)."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 out_features: int, bias: torch.Tensor | None) -> None:  # fmt: skip
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K/G, N, 2] bf16
        self.group_size = group_size
        self.out_features = out_features
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, self.group_size, self.scales_and_zeros
        )
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


class CompressedTensorsW4A16:
    name = "compressed-tensors"

    def __init__(self, config: dict[str, Any]) -> None:
        if config.get("format") not in ("pack-quantized", None):
            raise ValueError(f"unsupported compressed-tensors format {config.get('format')!r}")
        groups = config.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError("expected exactly one compressed-tensors config group")
        weights = next(iter(groups.values()))["weights"]
        if weights.get("num_bits") != 4 or weights.get("strategy") != "group":
            raise ValueError(
                "only 4-bit group-wise weight quantization (W4A16) is supported, got "
                f"num_bits={weights.get('num_bits')} strategy={weights.get('strategy')}"
            )
        self.group_size = int(weights["group_size"])
        self.symmetric = bool(weights.get("symmetric", True))
        self.ignore = list(config.get("ignore") or [])
        self._dense = Unquantized()

    def _is_ignored(self, prefix: str) -> bool:
        return any(prefix == name or prefix.endswith("." + name) for name in self.ignore)

    def dequantize(self, get: TensorSource, prefix: str) -> tuple[torch.Tensor, ...]:
        """(u [N, K] in 0..15, scale [N, K/G] fp32, zero_point [N, K/G] signed) of one layer."""
        out_features, in_features = (int(v) for v in get(f"{prefix}.weight_shape").tolist())
        u = unpack_int4(get(f"{prefix}.weight_packed"), in_features)
        scale = get(f"{prefix}.weight_scale").float()
        if self.symmetric:
            zero_point = torch.zeros_like(scale)
        else:
            packed_zp = get(f"{prefix}.weight_zero_point")  # packed along N
            zero_point = unpack_int4(packed_zp.t().contiguous(), out_features).t().float() - 8
        return u, scale, zero_point

    def load_linear(self, get, prefixes, bias, dtype, device) -> nn.Module:
        if any(self._is_ignored(p) for p in prefixes):
            return self._dense.load_linear(get, prefixes, bias, dtype, device)
        parts = [self.dequantize(get, p) for p in prefixes]
        u = torch.cat([p[0] for p in parts])
        scale = torch.cat([p[1] for p in parts])
        zero_point = torch.cat([p[2] for p in parts])
        b = load_bias(get, prefixes, dtype, device) if bias else None
        out_features, in_features = u.shape
        use_kernel = torch.device(device).type == "cpu" and in_features % self.group_size == 0
        if not use_kernel:  # dequantize once; the dense matmul runs on any device
            weight = (u.float() - 8 - zero_point.repeat_interleave(self.group_size, 1)) * (
                scale.repeat_interleave(self.group_size, 1)
            )
            return DenseLinear(weight.to(dtype=dtype, device=device), b)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 2)
        zero = -zero_point * scale
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16)
        return Int4Linear(packed, scales_and_zeros.contiguous(), self.group_size, out_features, b)


register_quantization("compressed-tensors", CompressedTensorsW4A16)
