"""4-bit weights: unpacking, dequantization, and a linear on torch's CPU int4 kernel.

Conventions here: `u` holds unsigned 4-bit values in [0, 15] (as int32), a group of
`group_size` consecutive input columns shares one scale and one zero point, and the
dequantized weight is W = (u - 8 - zero_point) * scale with a signed zero point (0 for
symmetric schemes). torch's kernel computes W = (u - 8) * scale + zero instead, so
zero = -zero_point * scale.
"""

from __future__ import annotations

import torch
from torch import nn

KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what `_weight_int4pack_mm_for_cpu` accepts
_INNER_K_TILES = 2
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i of a word sits at bits 4i


def unpack_int4(packed: torch.Tensor, num_columns: int) -> torch.Tensor:
    """[rows, words] int32, eight values per word, lowest nibble first ->
    [rows, num_columns] int32 in [0, 15]."""
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [rows, words, 8]
    return nibbles.reshape(packed.shape[0], -1)[:, :num_columns]


def dequantize(
    u: torch.Tensor,  # [out, in] int32 in [0, 15]
    scale: torch.Tensor,  # [out, in / group_size]
    zero_point: torch.Tensor,  # [out, in / group_size] signed
    group_size: int,
) -> torch.Tensor:  # [out, in] float32
    """The dense weight (u - 8 - zero_point) * scale, group by group."""
    out_features, in_features = u.shape
    grouped = u.float().view(out_features, in_features // group_size, group_size)
    weight = (grouped - 8 - zero_point.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)
    return weight.view(out_features, in_features)


def cpu_kernel_supports(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether torch's CPU int4 kernel takes this shape (else dequantize at load time)."""
    return (
        out_features % 16 == 0
        and group_size in KERNEL_GROUP_SIZES
        and in_features % group_size == 0
    )


class Int4Linear(nn.Module):
    """A W4A16 linear on torch's CPU int4 kernel; fast only with bf16 activations.

    Holds the weight in the kernel's packed layout ([out, in / 2] uint8, tiled) and
    `scales_and_zeros` [in / group_size, out, 2] bf16 (scale, zero) in the kernel's
    convention (see the module docstring).
    """

    def __init__(
        self,
        packed: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        group_size: int,
        out_features: int,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.group_size = group_size
        self.out_features = out_features
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_unpacked(
        cls,
        u: torch.Tensor,  # [out, in] int32 in [0, 15]
        scale: torch.Tensor,  # [out, in / group_size]
        zero_point: torch.Tensor,  # [out, in / group_size] signed
        group_size: int,
        bias: torch.Tensor | None,
    ) -> Int4Linear:
        """Repack into the kernel layout; `cpu_kernel_supports` must hold for the shape."""
        out_features, in_features = u.shape
        if not cpu_kernel_supports(out_features, in_features, group_size):
            raise ValueError(
                f"the CPU int4 kernel does not take out={out_features} in={in_features} "
                f"group_size={group_size}"
            )
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            u.to(torch.int32).contiguous(), _INNER_K_TILES
        )
        scale = scale.float()
        zero = -zero_point.float() * scale
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16)
        return cls(packed, scales_and_zeros.contiguous(), group_size, out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out], x's dtype
        dtype = x.dtype
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16).contiguous(), self.packed, self.group_size, self.scales_and_zeros
        )
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.to(dtype)
