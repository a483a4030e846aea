"""Paged attention in Triton for every token of a step, decode and prefill alike.

Reads K/V in place from the flat cache (`KVCache.kv`, [slots, 2, kv_heads, head_dim],
slot = block_id * block_size + offset) through the block tables, with the CPU kernel's
metadata (`AttentionMetadata.build(..., backend="triton")`): a query token at position p of
request r attends to r's keys at positions 0..p (with a sliding window W, p - W + 1..p: the
key loop starts at the tile's lowest such position, so blocks before every row's window are
never read). Decode, chunked prefill and prefill over a cached prefix are the same case.

The launches depend on nothing but `num_tokens` (and the model's shapes): the grid is
[num_tokens, num_kv_heads] and every loop bound is loaded from `token_position` inside the
kernel, so one captured CUDA graph replays for any context lengths, and a step needs no
host-side maximum (no sync). Program (t, h) looks at its row's neighbours in the batch:
- a request's only row this step (a decode token) is computed by the first launch: the
  GROUP query heads of kv head h are the rows of one tile (padded to 16 for tl.dot);
- rows of a request running several tokens, by the second launch, in tiles of TILE_Q
  consecutive positions (aligned to multiples of TILE_Q, plus the request's first row):
  the program of a tile's first row computes the whole tile (TILE_Q tokens x GROUP heads
  sharing each K/V load), the others return at once.
Keys are visited in tiles of BLOCK_N positions, each position's slot looked up in the block
table, so any block size works. Softmax is online and in fp32 (exp2 with the scale folded
in), key tile by key tile in position order; both matmuls run in the cache's dtype with fp32
accumulation. Rows that pad a batch beyond its real requests must point at a valid
(scratch) block at position 0; they read one key and never fault.

Requires: a request's rows are consecutive in the batch with consecutive positions (as
`AttentionMetadata.build` makes them); `head_dim` at least 16.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton import JITFunction


@triton.jit
def _attend(
    q_ptr,
    kv_ptr,
    out_ptr,
    table_row_ptr,  # this request's row of the block table
    token_request_ptr,
    token_position_ptr,
    first_row,
    request,
    kv_head,
    num_tokens,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_kv_slot,
    stride_kv_part,
    stride_kv_head,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # the cache's block size (any positive integer)
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_H: tl.constexpr,  # query heads per token, GROUP rounded up
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,  # 0: causal over all keys; else the sliding window
):
    """One tile: up to BLOCK_Q rows of `request` from `first_row` on, whose positions lie
    below the next multiple of BLOCK_Q, each with the GROUP query heads of `kv_head`."""
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)  # tile row = token * BLOCK_H + head in group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row = first_row + offs_m // BLOCK_H
    head = kv_head * GROUP + offs_m % BLOCK_H
    in_batch = row < num_tokens
    row_request = tl.load(token_request_ptr + row, mask=in_batch, other=-1)
    row_position = tl.load(token_position_ptr + row, mask=in_batch, other=0)
    first_position = tl.load(token_position_ptr + first_row)
    window_end = (first_position // BLOCK_Q + 1) * BLOCK_Q
    row_ok = (row_request == request) & (row_position < window_end)
    # rows of other requests (or past the batch) compute the first row's again, unstored
    row_position = tl.where(row_ok, row_position, first_position)
    query_ok = row_ok & (offs_m % BLOCK_H < GROUP)
    row64 = row.to(tl.int64)

    q = tl.load(
        q_ptr + row64[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :],
        mask=query_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = q.to(DOT_DTYPE)
    num_keys = tl.max(row_position, axis=0) + 1
    k_base = kv_ptr + kv_head * stride_kv_head
    v_base = k_base + stride_kv_part

    first_key = 0
    if WINDOW > 0:  # the first row has the tile's lowest position: its window starts first
        first_key = tl.maximum(first_position - WINDOW + 1, 0)

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(first_key, num_keys, BLOCK_N):
        key_position = start + tl.arange(0, BLOCK_N)
        key_ok = key_position < num_keys
        block = tl.load(table_row_ptr + key_position // BLOCK_SIZE, mask=key_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + key_position % BLOCK_SIZE
        kv_offsets = slot[:, None] * stride_kv_slot + offs_d[None, :]
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(v_base + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = key_position[None, :] <= row_position[:, None]  # causal, per row
        if WINDOW > 0:
            visible = visible & (key_position[None, :] > row_position[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # Without a window key 0 is in the first tile and visible to every row, so m_new is
        # finite from the first tile on. With one, a later row's window may start past this
        # key tile (all its scores -inf so far): exp2 must not see (-inf) - (-inf), so such
        # rows subtract 0 (p and alpha are then 0) and keep m_i at -inf.
        m_sub = m_new
        if WINDOW > 0:
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr
        + row64[:, None] * stride_out_token
        + head[:, None] * stride_out_head
        + offs_d[None, :],
        out,
        mask=query_ok[:, None] & d_ok[None, :],
    )


# num_tokens not specialized (Triton would compile anew for 1 and for multiples of 16)
@triton.jit(do_not_specialize=["num_tokens"])
def _paged_attention_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    block_table_ptr,
    token_request_ptr,
    token_position_ptr,
    num_tokens,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_kv_slot,
    stride_kv_part,
    stride_kv_head,
    stride_out_token,
    stride_out_head,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr,  # this launch's rows: True: lone tokens, False: the others' tiles
    TILE_Q: tl.constexpr,  # tokens per tile (1 for lone tokens)
    BLOCK_H: tl.constexpr,  # head rows per token (tl.dot needs TILE_Q * BLOCK_H >= 16)
    DOT_DTYPE: tl.constexpr,  # the cache's dtype (see `_dot_dtype`)
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,  # 0: none; else the sliding window (one compile per window)
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tl.load(token_request_ptr + row)
    prev_request = tl.load(token_request_ptr + row - 1, mask=row > 0, other=-1)
    next_request = tl.load(token_request_ptr + row + 1, mask=row + 1 < num_tokens, other=-1)
    table_row_ptr = block_table_ptr + request.to(tl.int64) * stride_table
    shared = (prev_request == request) | (next_request == request)  # not a decode token
    if DECODE:
        if not shared:
            _attend(
                q_ptr, kv_ptr, out_ptr, table_row_ptr, token_request_ptr, token_position_ptr,
                row, request, kv_head, num_tokens, scale_log2,
                stride_q_token, stride_q_head, stride_kv_slot, stride_kv_part, stride_kv_head,
                stride_out_token, stride_out_head,
                GROUP, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, 1, BLOCK_H, DOT_DTYPE,
                DOT_PRECISION, WINDOW,
            )  # fmt: skip
    else:
        position = tl.load(token_position_ptr + row)
        first_of_tile = (prev_request != request) | (position % TILE_Q == 0)
        if first_of_tile & shared:
            _attend(
                q_ptr, kv_ptr, out_ptr, table_row_ptr, token_request_ptr, token_position_ptr,
                row, request, kv_head, num_tokens, scale_log2,
                stride_q_token, stride_q_head, stride_kv_slot, stride_kv_part, stride_kv_head,
                stride_out_token, stride_out_head,
                GROUP, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, TILE_Q, BLOCK_H, DOT_DTYPE,
                DOT_PRECISION, WINDOW,
            )  # fmt: skip


# True: the kernels run in Triton's interpreter (numpy, CPU tensors; for tests). Triton reads
# TRITON_INTERPRET when it decorates a kernel: its own library's (tl.max, ...) when triton is
# first imported, ours when this module is; both must have seen it.
INTERPRETED = not isinstance(_paged_attention_kernel, JITFunction) and not isinstance(
    tl.standard.max, JITFunction
)

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _dot_dtype(cache_dtype: torch.dtype) -> tl.dtype:
    """The operand dtype of the kernel's two matmuls: the cache's, except fp32 for a bf16
    cache under TRITON_INTERPRET, whose tl.dot multiplies bf16 bit patterns as integers
    (triton-lang/triton#11584, "not supported yet")."""
    if cache_dtype not in _TL_DTYPES:
        raise ValueError(f"KV cache dtype {cache_dtype}; supported: float32, bfloat16, float16")
    if cache_dtype == torch.bfloat16 and INTERPRETED:
        return tl.float32
    return _TL_DTYPES[cache_dtype]


@functools.cache  # per layer and step otherwise
def launch_configs(
    group: int, head_dim: int, block_size: int, cache_dtype: torch.dtype
) -> tuple[dict, dict]:
    """The kernel's two launches (constexprs and num_warps), decode rows first. Each
    program of one returns at once where the other has its row; compiled apart, a decode
    token's small tile does not pay the registers of a prefill tile. Sizes chosen from
    ptxas's counts for sm_90 (bf16, head_dim 128, no spills): 111 registers a thread for
    decode, 237 for prefill tiles."""
    block_d = triton.next_power_of_2(head_dim)
    block_h = triton.next_power_of_2(group)
    shapes = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        DOT_DTYPE=_dot_dtype(cache_dtype),
        # fp32 means fp32: tl.dot would round fp32 inputs to tf32 on tensor cores
        DOT_PRECISION="ieee" if cache_dtype == torch.float32 else "tf32",
        num_warps=8,
    )
    # K and V tiles of 16 KiB each at most (bf16, head_dim 128), times the pipeline's stages
    tile_keys = 64 if block_d * cache_dtype.itemsize <= 256 else 32
    decode = dict(shapes, BLOCK_N=32, DECODE=True, TILE_Q=1, BLOCK_H=max(16, block_h))
    tiles = dict(
        shapes, BLOCK_N=tile_keys, DECODE=False, TILE_Q=max(1, 64 // block_h), BLOCK_H=block_h
    )
    return decode, tiles


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], any float dtype and row strides
    kv: torch.Tensor,  # [num_slots, 2, num_kv_heads, head_dim]: the layer's cache
    block_table: torch.Tensor,  # [num_requests, width] int32
    token_request: torch.Tensor,  # [num_tokens] int32
    token_position: torch.Tensor,  # [num_tokens] int32
    block_size: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] in q's dtype
    """Attention of every query token over its request's keys at positions <= its own
    (with `window`, the last `window` of them), computed in the cache's dtype with fp32
    softmax and accumulation. Does not modify the cache (write the step's K/V first).
    Asynchronous, no host sync: safe to capture in a CUDA graph."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv.shape[2]
    if num_heads % num_kv_heads or head_dim < 16 or kv.shape[1:] != (2, num_kv_heads, head_dim):
        raise ValueError(f"q {tuple(q.shape)} does not fit the KV cache {tuple(kv.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("the KV cache and the block table need a contiguous last dim")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    args = (
        q,
        kv,
        out,
        block_table,
        token_request,
        token_position,
        num_tokens,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
    )
    grid = (num_tokens, num_kv_heads)
    for launch in launch_configs(num_heads // num_kv_heads, head_dim, block_size, kv.dtype):
        _paged_attention_kernel[grid](*args, **launch, WINDOW=window or 0)
    return out
