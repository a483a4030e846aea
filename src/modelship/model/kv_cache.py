"""The paged KV cache: one pair of flat slot tensors per layer."""

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
    """

    kv: torch.Tensor  # [num_blocks * block_size, 2, num_kv_heads, head_dim]

    @property
    def k(self) -> torch.Tensor:  # [num_blocks * block_size, num_kv_heads, head_dim], a view
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:  # [num_blocks * block_size, num_kv_heads, head_dim], a view
        return self.kv[:, 1]


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers (keys and values), to size the pool."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCache]:
    """Zero-filled caches, one per layer, each with `num_blocks * block_size` slots."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(
            f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
        )
    shape = (num_blocks * block_size, 2, config.num_kv_heads, config.head_dim)
    return [
        KVCache(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(config.num_layers)
    ]
