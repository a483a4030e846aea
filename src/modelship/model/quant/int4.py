"""4-bit weights: unpacking, dequantization, and linears on int4 kernels (CPU and CUDA).

Conventions here: `u` holds unsigned 4-bit values in [0, 15] (as int32), a group of
`group_size` consecutive input columns shares one scale and one zero point, and the
dequantized weight is W = (u - 8 - zero_point) * scale with a signed zero point (0 for
symmetric schemes). torch's kernels (the CPU one and CUDA's tinygemm) compute
W = (u - 8) * scale + zero instead, so zero = -zero_point * scale, both held in bf16 as
`scales_and_zeros` [in / group_size, out, 2].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from modelship.model import cpu_kernels

KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU and CUDA int4 kernels accept
_INNER_K_TILES = 2
# tinygemm packs 2, 4 or 8 k-tiles of 16 input columns side by side; 8 (16-byte loads) is
# the fastest, so take the largest that divides the input width.
_CUDA_INNER_K_TILES = (8, 4, 2)
_CUDA_N_TILE = 8  # output rows per tinygemm tile: the packed weight is [out / 8, ...]
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


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_int4`: [rows, columns] in [0, 15] -> [rows, ceil(columns / 8)]
    int32, lowest nibble first (compressed-tensors' layout; columns padded with zeros)."""
    rows, columns = u.shape
    padded = torch.zeros(rows, -(-columns // 8) * 8, dtype=torch.int64, device=u.device)
    padded[:, :columns] = u.to(torch.int64) & 0xF
    words = (padded.view(rows, -1, 8) << _SHIFTS.to(u.device, torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement


def scales_and_zeros(
    scale: torch.Tensor,  # [out, in / group_size]
    zero_point: torch.Tensor,  # [out, in / group_size] signed
) -> torch.Tensor:  # [in / group_size, out, 2] bf16
    """torch's int4 kernels' (scale, zero) pairs, zero = -zero_point * scale (see above)."""
    scale = scale.float()
    zero = -zero_point.float() * scale
    return torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()


def cpu_kernel_supports(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether torch's CPU int4 kernel takes this shape (else dequantize at load time)."""
    return (
        out_features % 16 == 0
        and group_size in KERNEL_GROUP_SIZES
        and in_features % group_size == 0
    )


class _TorchInt4Linear(nn.Module):
    """What torch's int4 kernels (CPU and CUDA tinygemm) hold: the weight in the kernel's
    packed layout and `scales_and_zeros` [in / group_size, out, 2] bf16 (scale, zero)."""

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


class Int4Linear(_TorchInt4Linear):
    """A W4A16 linear on torch's CPU int4 kernel; fast only with bf16 activations.

    Holds the weight in the kernel's packed layout ([out, in / 2] uint8, tiled) and
    `scales_and_zeros` [in / group_size, out, 2] bf16 (scale, zero) in the kernel's
    convention (see the module docstring).
    """

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
        return cls(packed, scales_and_zeros(scale, zero_point), group_size, out_features, bias)

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
    way whatever else is in the batch (batch-invariant). Holds the weight repacked at load
    time in the kernel's row-interleaved layout (`cpu_kernels.pack_q4`: 8 output rows per
    block, `qweight` [ceil(out / 8), 4 in] uint8, `scales`/`mins` fp16).
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None,
        out_features: int,
    ) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.group_size = group_size
        self.in_features = qweight.shape[1] // 4
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
    ) -> W4A8Linear:
        out_features, in_features = u.shape
        if not cpu_kernels.supports(out_features, in_features, group_size):
            raise ValueError(
                f"the W4A8 kernel does not take in={in_features} group_size={group_size}"
            )
        return cls(*cpu_kernels.pack_q4(u, scale, zero_point), group_size, bias, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out], x's dtype
        dtype = x.dtype
        if dtype not in (torch.bfloat16, torch.float32):
            x = x.float()
        y = cpu_kernels.q4_linear(
            x.contiguous(), self.qweight, self.scales, self.mins, self.group_size
        )
        if y.shape[1] != self.out_features:  # the last block's padding rows
            y = y[:, : self.out_features]
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


# CUDA: torch's tinygemm kernel (`_weight_int4pack_mm`), bf16 activations x int4 weights on
# tensor cores (mma m16n8k16, sm80+). The weight is repacked on the device by
# `_convert_weight_to_int4pack`, which takes [out, in / 2] uint8 with two columns a byte:
# the even column in the HIGH nibble, the odd one in the low nibble (the reverse of
# compressed-tensors' lowest-nibble-first order), and returns
# [out / 8, in / (inner_k_tiles * 16), 32, inner_k_tiles / 2] int32.


class TinyGemmOperands(NamedTuple):
    """What the CUDA kernel is built from, prepared on the CPU."""

    packed_pairs: torch.Tensor  # [out, in / 2] uint8, even column in the high nibble
    scales_and_zeros: torch.Tensor  # [in / group_size, out, 2] bf16


def cuda_kernel_available(device: torch.device | str) -> bool:
    """Whether `device` can run tinygemm: a CUDA GPU with bf16 tensor cores (sm80+)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def cuda_inner_k_tiles(in_features: int) -> int | None:
    """The largest inner k-tile count the input width takes (None: none does)."""
    for tiles in _CUDA_INNER_K_TILES:
        if in_features % (tiles * 16) == 0:
            return tiles
    return None


def cuda_kernel_supports(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether tinygemm takes this shape (else dequantize at load time): whole tiles of 8
    output rows and of 2 x 16 input columns, and a kernel group size dividing the input."""
    return (
        out_features % _CUDA_N_TILE == 0
        and group_size in KERNEL_GROUP_SIZES
        and in_features % group_size == 0
        and cuda_inner_k_tiles(in_features) is not None
    )


def prepare_tinygemm_operands(
    u: torch.Tensor,  # [out, in] int32 in [0, 15]
    scale: torch.Tensor,  # [out, in / group_size]
    zero_point: torch.Tensor,  # [out, in / group_size] signed
) -> TinyGemmOperands:
    """The converter's uint8 input and the kernel's scales and zeros (pure, any device)."""
    u = u.to(torch.uint8)
    packed_pairs = (u[:, 0::2] << 4) | u[:, 1::2]
    return TinyGemmOperands(packed_pairs.contiguous(), scales_and_zeros(scale, zero_point))


class CudaInt4Linear(_TorchInt4Linear):
    """A W4A16 linear on torch's CUDA tinygemm kernel; bf16 arithmetic whatever x's dtype.

    Holds the kernel's tiled weight ([out / 8, in / (inner_k_tiles * 16), 32,
    inner_k_tiles / 2] int32) and `scales_and_zeros` [in / group_size, out, 2] bf16.
    """

    @classmethod
    def from_unpacked(
        cls,
        u: torch.Tensor,  # [out, in] int32 in [0, 15]
        scale: torch.Tensor,  # [out, in / group_size]
        zero_point: torch.Tensor,  # [out, in / group_size] signed
        group_size: int,
        bias: torch.Tensor | None,
        device: torch.device | str,
    ) -> CudaInt4Linear:
        """Repack on `device` (a CUDA GPU); `cuda_kernel_supports` must hold for the shape."""
        out_features, in_features = u.shape
        inner_k_tiles = cuda_inner_k_tiles(in_features)
        if not cuda_kernel_supports(out_features, in_features, group_size) or not inner_k_tiles:
            raise ValueError(
                f"the CUDA int4 kernel does not take out={out_features} in={in_features} "
                f"group_size={group_size}"
            )
        operands = prepare_tinygemm_operands(u, scale, zero_point)
        packed = torch.ops.aten._convert_weight_to_int4pack(
            operands.packed_pairs.to(device), inner_k_tiles
        )
        return cls(
            packed,
            operands.scales_and_zeros.to(device),
            group_size,
            out_features,
            bias.to(device) if bias is not None else None,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out], x's dtype
        dtype = x.dtype
        if x.shape[0] == 0:  # the kernel launches no grid for zero rows
            return x.new_empty(0, self.out_features)
        y = torch.ops.aten._weight_int4pack_mm(
            x.to(torch.bfloat16).contiguous(), self.packed, self.group_size, self.scales_and_zeros
        )
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.to(dtype)
