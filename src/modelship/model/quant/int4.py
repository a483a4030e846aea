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

from modelship.model import cpu_kernels

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


class W4A8Linear(nn.Module):
    """4-bit weights x int8 activations on modelship's AVX2 kernel (`cpu_kernels`).

    About twice as fast as `Int4Linear` on AVX2 CPUs (no native bf16): activations are
    quantized per row and weight group to int8 on the fly and the products summed in
    integers, as llama.cpp's Q4 x Q8 dot product does. Each output row is computed the same
    way whatever else is in the batch (batch-invariant). Holds `qweight` [out, in / 2]
    uint8 and `scales`/`mins` [out, in / group_size] fp16 (`cpu_kernels.pack_q4`).
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.group_size = group_size
        self.out_features = qweight.shape[0]
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_unpacked(
        cls,
        u: torch.Tensor,  # [out, in] int32 in [0, 15]
        scale: torch.Tensor,  # [out, in / group_size]
        zero_point: torch.Tensor,  # [out, in / group_size] signed
        group_size: int,
        bias: torch.Tensor | None,
    ) -> W4A8Linear:
        out_features, in_features = u.shape
        if not cpu_kernels.supports(out_features, in_features, group_size):
            raise ValueError(
                f"the W4A8 kernel does not take in={in_features} group_size={group_size}"
            )
        return cls(*cpu_kernels.pack_q4(u, scale, zero_point), group_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out], x's dtype
        dtype = x.dtype
        if dtype not in (torch.bfloat16, torch.float32):
            x = x.float()
        y = cpu_kernels.q4_linear(
            x.contiguous(), self.qweight, self.scales, self.mins, self.group_size
        )
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.to(dtype)


INT4_KERNELS = ("auto", "w4a8", "torch")


def create_int4_linear(
    u: torch.Tensor,  # [out, in] int32 in [0, 15]
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    kernel: str = "auto",
) -> nn.Module | None:
    """The fastest CPU int4 linear that takes this shape, or None (dequantize instead).

    `kernel`: "auto" (W4A8 where the CPU and shape allow, else torch's), "w4a8" (fails if
    unavailable), "torch" (`Int4Linear`, bf16 arithmetic)."""
    if kernel not in INT4_KERNELS:
        raise ValueError(f"int4 kernel {kernel!r}; supported: {', '.join(INT4_KERNELS)}")
    out_features, in_features = u.shape
    if kernel != "torch" and cpu_kernels.supports(out_features, in_features, group_size):
        if cpu_kernels.load():
            return W4A8Linear.from_unpacked(u, scale, zero_point, group_size, bias)
        if kernel == "w4a8":
            raise RuntimeError("the W4A8 kernel is unavailable on this machine (needs AVX2)")
    elif kernel == "w4a8":
        raise ValueError(f"the W4A8 kernel does not take in={in_features} group_size={group_size}")
    if cpu_kernel_supports(out_features, in_features, group_size):
        return Int4Linear.from_unpacked(u, scale, zero_point, group_size, bias)
    return None
