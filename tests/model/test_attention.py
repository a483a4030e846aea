"""Paged attention and its metadata against a plain-torch reference."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from modelship.model import AttentionMetadata, KVCache, cpu_kernels
from modelship.model.attention import paged_attention, resolve_attention_backend

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8


def ref_paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    cache_k: torch.Tensor,  # [slots, kv_heads, head_dim], this step's K/V not yet written
    cache_v: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [num_tokens, heads, head_dim] float64
    """Token by token, head by head, in float64: the definition, not an implementation.
    With `window`, a query at position p sees p - window + 1 .. p (block tables may hold -1
    for blocks no query sees)."""
    cache_k, cache_v = cache_k.double().clone(), cache_v.double().clone()
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len)]
        for j in range(query_len):  # write this step's K/V first: a query sees its own token
            cache_k[slots[seq_len - query_len + j]] = k[row + j].double()
            cache_v[slots[seq_len - query_len + j]] = v[row + j].double()
        for j in range(query_len):
            position = seq_len - query_len + j
            first = 0 if window is None else max(0, position - window + 1)
            visible = slots[first : position + 1]
            assert min(visible) >= 0, "a query sees a block the table no longer holds"
            for h in range(q.shape[1]):
                keys = cache_k[visible, h // group]  # [position + 1, head_dim]
                values = cache_v[visible, h // group]
                weights = torch.softmax(keys @ q[row + j, h].double() * scale, dim=0)
                out[row + j, h] = weights @ values
        row += query_len
    return out


def random_step(query_lens, seq_lens, num_slots, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(query_lens)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    # the cache already holds every request's computed prefix (and garbage elsewhere)
    cache = KVCache(torch.randn(num_slots, 2, KV_HEADS, HEAD_DIM, generator=gen))
    return q, k, v, cache


BACKENDS = [
    "sdpa",
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not cpu_kernels.load(), reason="needs AVX2 and a compiler"),
    ),
]


# Request order mixes decodes (query_len 1) between prefills, with scattered blocks.
MIXED = dict(
    query_lens=[1, 5, 1, 3, 7],
    seq_lens=[9, 5, 2, 11, 7],
    block_tables=[[7, 2, 12], [3, 9], [15], [0, 14, 5], [11, 1]],
)


@pytest.mark.parametrize(
    "case",
    [
        MIXED,
        dict(query_lens=[1, 1, 1], seq_lens=[13, 4, 1], block_tables=[[8, 3, 1, 6], [2], [0]]),
        dict(query_lens=[1, 1], seq_lens=[6, 6], block_tables=[[5, 2], [1, 4]]),  # no padding
        dict(query_lens=[6], seq_lens=[6], block_tables=[[4, 1]]),
        dict(query_lens=[4, 2], seq_lens=[10, 3], block_tables=[[9, 3, 6], [0]]),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(case: dict, backend: str) -> None:
    q, k, v, cache = random_step(case["query_lens"], case["seq_lens"], num_slots=16 * BLOCK)
    expected = ref_paged_attention(q, k, v, cache.k, cache.v, **case, scale=0.3)
    meta = AttentionMetadata.build(**case, block_size=BLOCK, device="cpu", backend=backend)
    out = paged_attention(q, torch.stack([k, v], dim=1), cache, meta, scale=0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # the step's K/V landed in its slots
    torch.testing.assert_close(cache.k[meta.slot_mapping], k)
    torch.testing.assert_close(cache.v[meta.slot_mapping], v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_queries_with_fp32_cache(backend: str) -> None:
    q, k, v, cache = random_step(num_slots=16 * BLOCK, dtype=torch.bfloat16, **_lens(MIXED))
    expected = ref_paged_attention(q, k, v, cache.k, cache.v, **MIXED, scale=0.3)
    meta = AttentionMetadata.build(**MIXED, block_size=BLOCK, device="cpu", backend=backend)
    out = paged_attention(q, torch.stack([k, v], dim=1), cache, meta, scale=0.3)
    assert out.dtype == torch.bfloat16 and cache.k.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


# Windows of 3 and 5 keys; -1: blocks wholly before every query's window, handed back to
# the pool (as `BlockManager` does for a model whose every layer is windowed).
WINDOWED = [
    (3, dict(query_lens=[1, 5, 1, 3], seq_lens=[13, 5, 2, 11],
             block_tables=[[-1, -1, 8, 3], [12, 9], [15], [-1, 0, 14]])),
    (5, dict(query_lens=[7, 1, 1], seq_lens=[16, 9, 21],
             block_tables=[[-1, 4, 1, 6], [-1, 2, 7], [-1, -1, -1, 10, 11, 13]])),
    (5, dict(query_lens=[11], seq_lens=[11], block_tables=[[4, 1, 6]])),  # a whole prompt
]  # fmt: skip


@pytest.mark.parametrize(("window", "case"), WINDOWED)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_matches_reference(window: int, case: dict, backend: str) -> None:
    q, k, v, cache = random_step(case["query_lens"], case["seq_lens"], num_slots=16 * BLOCK)
    expected = ref_paged_attention(q, k, v, cache.k, cache.v, **case, scale=0.3, window=window)
    meta = AttentionMetadata.build(**case, block_size=BLOCK, device="cpu", backend=backend)
    out = paged_attention(q, torch.stack([k, v], dim=1), cache, meta, scale=0.3, window=window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # the window bites: without it the outputs differ
    full = ref_paged_attention(q, k, v, cache.k, cache.v, **_unwindowed(case), scale=0.3)
    assert not torch.allclose(full, expected, atol=1e-3)


def _unwindowed(case: dict) -> dict:
    """`case` with its -1 blocks swapped for real ones (their contents: noise)."""
    tables = [[5 if b == -1 else b for b in table] for table in case["block_tables"]]
    return {**case, "block_tables": tables}


def _lens(case: dict) -> dict:
    return {"query_lens": case["query_lens"], "seq_lens": case["seq_lens"]}


def test_metadata_slots_and_decode_batch() -> None:
    meta = AttentionMetadata.build(
        query_lens=[2, 1, 3],
        seq_lens=[6, 3, 3],
        block_tables=[[5, 2], [7], [1, 9]],
        block_size=BLOCK,
        device="cpu",
    )
    # request 0: positions 4, 5 -> block 2; request 1: position 2 -> block 7;
    # request 2: positions 0..2 -> block 1
    assert meta.slot_mapping.tolist() == [8, 9, 30, 4, 5, 6]
    assert (meta.num_tokens, meta.num_decode) == (6, 1)
    assert meta.decode_rows is not None and meta.decode_rows.tolist() == [2]
    assert meta.decode_slots is not None and meta.decode_slots.tolist() == [[28, 29, 30]]
    assert meta.decode_mask is None  # a single decode request needs no padding mask
    chunked, whole = meta.prefills
    assert (chunked.start, chunked.num_tokens) == (0, 2)
    assert chunked.context_slots is not None
    assert chunked.context_slots.tolist() == [20, 21, 22, 23, 8, 9]
    assert chunked.mask is not None and chunked.mask.sum(1).tolist() == [5, 6]
    assert (whole.start, whole.context_slots, whole.mask) == (3, None, None)


def test_triton_metadata_is_the_cpu_kernels() -> None:
    cpu = AttentionMetadata.build(**MIXED, block_size=BLOCK, device="cpu", backend="cpu")
    triton = AttentionMetadata.build(**MIXED, block_size=BLOCK, device="cpu", backend="triton")
    assert (cpu.backend, triton.backend) == ("cpu", "triton")
    for name in ("slot_mapping", "block_table", "token_request", "token_position"):
        ours, theirs = getattr(cpu, name), getattr(triton, name)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
    assert triton.block_table is not None and triton.block_table.is_contiguous()
    assert (triton.num_tokens, triton.block_size, triton.prefills) == (17, BLOCK, [])


def test_metadata_rejects_short_block_tables() -> None:
    with pytest.raises(ValueError, match="at least 2 blocks"):
        AttentionMetadata.build([1], [5], [[3]], BLOCK, "cpu")
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([4], [3], [[3]], BLOCK, "cpu")


@pytest.mark.skipif(not cpu_kernels.load(), reason="needs AVX2 and a compiler")
def test_cpu_kernel_is_batch_and_chunk_invariant() -> None:
    """A query's output is bitwise the same alone, in a batch, and whether its prompt ran in
    one chunk or in pieces (what deterministic greedy decoding rests on)."""
    gen = torch.Generator().manual_seed(3)
    seq_len, table = 11, [6, 2, 9]
    q = torch.randn(seq_len, HEADS, HEAD_DIM, generator=gen)
    kv = torch.randn(seq_len, 2, KV_HEADS, HEAD_DIM, generator=gen)
    noise = torch.randn(16 * BLOCK, 2, KV_HEADS, HEAD_DIM, generator=gen)

    def run(query_lens, seq_lens, tables, rows_q, rows_kv):
        cache = KVCache(noise.clone())
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK, "cpu", "cpu")
        return paged_attention(rows_q, rows_kv, cache, meta, 0.3)

    whole = run([seq_len], [seq_len], [table], q, kv)
    # the same prompt in chunks of 4, 4 and 3, each step's output compared with its rows
    cache = KVCache(noise.clone())
    for start, end in ((0, 4), (4, 8), (8, 11)):
        meta = AttentionMetadata.build([end - start], [end], [table], BLOCK, "cpu", "cpu")
        chunk = paged_attention(q[start:end], kv[start:end], cache, meta, 0.3)
        assert torch.equal(chunk, whole[start:end])
    # the last token as a decode step beside other requests
    other_q = torch.randn(3, HEADS, HEAD_DIM, generator=gen)
    other_kv = torch.randn(3, 2, KV_HEADS, HEAD_DIM, generator=gen)
    cache = KVCache(noise.clone())
    prefix = AttentionMetadata.build([seq_len - 1], [seq_len - 1], [table], BLOCK, "cpu", "cpu")
    paged_attention(q[:-1], kv[:-1], cache, prefix, 0.3)
    meta = AttentionMetadata.build([2, 1], [5, seq_len], [[12, 13], table], BLOCK, "cpu", "cpu")
    out = paged_attention(
        torch.cat([other_q[:2], q[-1:]]), torch.cat([other_kv[:2], kv[-1:]]), cache, meta, 0.3
    )
    assert torch.equal(out[2], whole[-1])


def test_attention_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) == "sdpa"  # bf16 cache
    assert resolve_attention_backend("sdpa", "cpu", torch.float32) == "sdpa"
    assert resolve_attention_backend("sdpa", "cuda", torch.bfloat16) == "sdpa"
    expected = "cpu" if cpu_kernels.load() else "sdpa"
    assert resolve_attention_backend("auto", "cpu", torch.float32) == expected
    with pytest.raises(ValueError, match="supported: auto, cpu, triton, sdpa"):
        resolve_attention_backend("flash", "cpu", torch.float32)
    with pytest.raises(ValueError, match="fp32 KV cache"):
        resolve_attention_backend("cpu", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="CPU device"):
        resolve_attention_backend("cpu", "cuda", torch.float32)
    # CUDA: Triton where it imports (resolving touches no GPU)
    has_triton = importlib.util.find_spec("triton") is not None
    triton_or_sdpa = "triton" if has_triton else "sdpa"
    assert resolve_attention_backend("auto", "cuda", torch.bfloat16) == triton_or_sdpa
    # on a CPU only under Triton's interpreter (tests/model/test_triton_attention.py)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton attention backend needs"):
        resolve_attention_backend("triton", "cpu", torch.float32)
