"""The KV cache tensors: per layer, one flat slot axis (slot = block_id * block_size + offset)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelship.model.config import ModelConfig


@dataclass
class KVCache:
    k: torch.Tensor  # [num_blocks * block_size, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_blocks * block_size, num_kv_heads, head_dim]


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCache]:
    shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
    return [
        KVCache(torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]  # fmt: skip
