"""The paged KV cache: one pair of flat slot tensors per layer, fp32/bf16/fp16, int8 or fp8."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelship.model.config import ModelConfig


@dataclass
class KVCache:
    """Keys and values of one layer for every slot of the block pool.

    Slot `block_id * block_size + offset` holds the token at `offset` of physical block
    `block_id`. A slot's key and value sit side by side, so attention writes and gathers
    both with one op. The dtype may differ from the compute dtype; attention casts on write
    and read. Unwritten slots are zero (never NaN), so masked-out padding reads are harmless.

    An int8 or fp8 cache also holds `scales`: each written key or value head vector x is
    stored as round(x / s) with s = absmax(x) / 127 (int8), or as x / s cast to float8_e4m3fn
    with s = absmax(x) / 448 (fp8: e4m3's largest finite value; `quantize_kv`), and s sits in
    the same slot, so a block carries its own scales (prefix-cache hits need nothing else).
    """

    kv: torch.Tensor  # [num_blocks * block_size, 2, num_kv_heads, head_dim]
    scales: torch.Tensor | None = None  # [num_blocks * block_size, 2, num_kv_heads] fp32: int8/fp8

    @property
    def k(self) -> torch.Tensor:  # [num_blocks * block_size, num_kv_heads, head_dim], a view
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:  # [num_blocks * block_size, num_kv_heads, head_dim], a view
        return self.kv[:, 1]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype keys and values are read in: the storage's, fp32 for an int8/fp8 cache."""
        return self.kv.dtype if self.scales is None else self.scales.dtype

    def write(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store `kv` [n, 2, num_kv_heads, head_dim] (in `self.dtype`) at `slots` [n]."""
        if self.scales is None:
            self.kv.index_copy_(0, slots, kv)
            return
        values, scales = quantize_kv(kv, self.kv.dtype)
        # fp8 through its bytes: CPU torch has no index_copy_/index_select for float8 types
        _as_bytes(self.kv).index_copy_(0, slots, _as_bytes(values))
        self.scales.index_copy_(0, slots, scales)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """[n, 2, num_kv_heads, head_dim] in `self.dtype`: the slots' K/V, dequantized.
        Does not modify the cache."""
        if self.scales is None:
            return self.kv.index_select(0, slots)
        values = _as_bytes(self.kv).index_select(0, slots).view(self.kv.dtype)
        return dequantize_kv(values, self.scales.index_select(0, slots))


FP8_DTYPE = torch.float8_e4m3fn
# Storage dtypes that keep one fp32 scale per key/value head vector, and the largest value
# a scaled vector may reach in each.
QUANTIZED_KV_DTYPES = {torch.int8: 127.0, FP8_DTYPE: torch.finfo(FP8_DTYPE).max}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def quantize_kv(
    x: torch.Tensor, dtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] float -> (int8 or fp8 [..., head_dim], fp32 scales [...]): symmetric
    absmax per head vector; int8 rounded to nearest even (as `csrc/attention_cpu.cpp` writes
    them), fp8 by torch's round-to-nearest cast (clamped first: e4m3fn has no inf, an
    overflow would become NaN)."""
    limit = QUANTIZED_KV_DTYPES[dtype]
    x = x.float()
    scales = x.abs().amax(dim=-1) / limit
    inv = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    scaled = x * inv.unsqueeze(-1)
    if dtype == torch.int8:
        scaled = scaled.round_()
    return scaled.clamp_(-limit, limit).to(dtype), scales


def dequantize_kv(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8/fp8 [..., head_dim] and fp32 scales [...] -> fp32 [..., head_dim]."""
    return values.float() * scales.unsqueeze(-1)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers (keys, values and, int8/fp8, their scales),
    to size the pool."""
    vectors = 2 * config.num_layers * block_size * config.num_kv_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    scale_bytes = 4 if dtype in QUANTIZED_KV_DTYPES else 0
    return vectors * (config.head_dim * itemsize + scale_bytes)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCache]:
    """Zero-filled caches, one per layer, each with `num_blocks * block_size` slots; an int8
    or fp8 `dtype` gives int8/fp8 values with fp32 scales."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(
            f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
        )
    shape = (num_blocks * block_size, 2, config.num_kv_heads, config.head_dim)
    caches = []
    for _ in range(config.num_layers):
        kv = torch.zeros(shape, dtype=dtype, device=device)
        scales = None
        if dtype in QUANTIZED_KV_DTYPES:
            scales = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
        caches.append(KVCache(kv, scales))
    return caches
