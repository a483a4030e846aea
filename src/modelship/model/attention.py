"""Paged attention over the flat KV cache, with SDPA.

Measured on a 2-core CPU: fp32 `scaled_dot_product_attention(..., enable_gqa=True)` is fast
and exact for decode, bf16 SDPA is several times slower, and repeating KV heads costs more
than it saves. So attention runs in the KV cache's dtype (fp32 on CPU by default), all
decode sequences (one query token) in one batched SDPA call over their gathered, padded
contexts, and each prefill chunk in its own call with a causal mask offset by the tokens
already computed. Everything index-like is built once per step in `AttentionMetadata.build`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from modelship.model.kv_cache import KVCache


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    context_slots: torch.Tensor | None  # [seq_len] slots of the whole context; None: no prefix
    mask: torch.Tensor | None  # [num_tokens, seq_len] bool; None: plain causal


@dataclass
class AttentionMetadata:
    """Where this step's tokens write K/V and which slots each query reads."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode_rows: torch.Tensor | None  # [num_decode] rows of single-token sequences
    decode_slots: torch.Tensor | None  # [num_decode, max_len] context slots, padded
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_len] True = attend
    prefills: list[PrefillChunk]
    num_tokens: int

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Request i runs `query_lens[i]` new tokens, the last ones of its `seq_lens[i]`."""
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_contexts: list[list[int]] = []
        prefills: list[PrefillChunk] = []
        row = 0
        for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            context = _slots(table, seq_len, block_size)
            slots.extend(context[seq_len - query_len :])
            if query_len == 1:
                decode_rows.append(row)
                decode_contexts.append(context)
            elif query_len == seq_len:
                prefills.append(PrefillChunk(row, query_len, None, None))
            else:
                offset = seq_len - query_len
                positions = torch.arange(query_len, device=device).unsqueeze(1) + offset
                mask = torch.arange(seq_len, device=device).unsqueeze(0) <= positions
                prefills.append(
                    PrefillChunk(row, query_len, torch.tensor(context, device=device), mask)
                )
            row += query_len
        decode_slots = decode_mask = rows = None
        if decode_rows:
            width = max(len(c) for c in decode_contexts)
            padded = [c + [0] * (width - len(c)) for c in decode_contexts]
            decode_slots = torch.tensor(padded, dtype=torch.long, device=device)
            lengths = torch.tensor([len(c) for c in decode_contexts], device=device)
            decode_mask = (torch.arange(width, device=device) < lengths.unsqueeze(1))[
                :, None, None, :
            ]
            rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            decode_rows=rows,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefills,
            num_tokens=row,
        )


def _slots(block_table: list[int], num_tokens: int, block_size: int) -> list[int]:
    return [block_table[i // block_size] * block_size + i % block_size for i in range(num_tokens)]


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """Write this step's K/V into the cache, then attend through the block tables."""
    out_dtype, work_dtype = q.dtype, cache.k.dtype
    k = k.to(work_dtype)
    v = v.to(work_dtype)
    cache.k.index_copy_(0, meta.slot_mapping, k)
    cache.v.index_copy_(0, meta.slot_mapping, v)
    q = q.to(work_dtype)
    if meta.decode_rows is not None and not meta.prefills:
        return _decode(q, cache, meta, scale).to(out_dtype)
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        out[meta.decode_rows] = _decode(q.index_select(0, meta.decode_rows), cache, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        if chunk.context_slots is None:  # whole prompt in this chunk: its K/V are at hand
            kc, vc = k[rows], v[rows]
        else:
            kc = cache.k.index_select(0, chunk.context_slots)
            vc = cache.v.index_select(0, chunk.context_slots)
        o = F.scaled_dot_product_attention(
            qc,
            kc.transpose(0, 1).unsqueeze(0),
            vc.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out.to(out_dtype)


def _decode(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float):
    """One query token per sequence: q [num_decode, heads, head_dim] -> same shape."""
    assert meta.decode_slots is not None
    num_decode, width = meta.decode_slots.shape
    flat = meta.decode_slots.reshape(-1)
    keys = cache.k.index_select(0, flat).view(num_decode, width, *cache.k.shape[1:])
    values = cache.v.index_select(0, flat).view(num_decode, width, *cache.v.shape[1:])
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [num_decode, heads, 1, head_dim]
        keys.transpose(1, 2),  # [num_decode, kv_heads, width, head_dim]
        values.transpose(1, 2),
        attn_mask=meta.decode_mask,
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(2)
