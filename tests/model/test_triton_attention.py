"""The Triton paged-attention kernel against a plain SDPA reference, and the whole model on it
against SDPA: on a GPU where there is one, else on CPU tensors in Triton's interpreter.

Triton reads TRITON_INTERPRET when it decorates a kernel, its own library's at its first
import; tests/conftest.py sets it before any test module imports triton where there is no
GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from modelship.model import AttentionMetadata, KVCache, triton_attention
from modelship.model.attention import paged_attention, resolve_attention_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not triton_attention.INTERPRETED:
    pytest.skip(
        "no GPU, and triton was imported before TRITON_INTERPRET=1 was set",
        allow_module_level=True,
    )

SCALE = 0.125


def ref_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    kv: torch.Tensor,  # [slots, 2, kv_heads, head_dim], this step's K/V written
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    window: int | None = None,
) -> torch.Tensor:  # [num_tokens, heads, head_dim] float64
    """Request by request: gather the context through the block table, then float64 SDPA
    with a causal mask offset by the tokens already computed (and the sliding window)."""
    out, row = [], 0
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        context = kv[slots].double()  # [seq_len, 2, kv_heads, head_dim]
        positions = torch.arange(seq_len - query_len, seq_len)
        mask = torch.arange(seq_len)[None, :] <= positions[:, None]  # [query_len, seq_len]
        if window is not None:
            mask &= torch.arange(seq_len)[None, :] > positions[:, None] - window
        o = F.scaled_dot_product_attention(
            q[row : row + query_len].double().transpose(0, 1),  # [heads, query_len, head_dim]
            context[:, 0].transpose(0, 1),  # [kv_heads, seq_len, head_dim]
            context[:, 1].transpose(0, 1),
            attn_mask=mask,
            scale=SCALE,
            enable_gqa=True,
        )
        out.append(o.transpose(0, 1))
        row += query_len
    return torch.cat(out)


def random_step(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """On DEVICE: q (a strided view, as the model passes it), the step's K/V, a cache
    holding every request's prefix among noise; scattered block tables (block 0 unused)."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(query_lens)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for seq_len in seq_lens:
        count = -(-seq_len // block_size)
        tables.append(order[:count])
        order = order[count:]
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=gen)
    qkv = qkv.to(DEVICE, dtype)
    q, kv = qkv[:, :heads], qkv[:, heads:].view(num_tokens, 2, kv_heads, head_dim)
    noise = torch.randn(num_blocks * block_size, 2, kv_heads, head_dim, generator=gen)
    return q, kv, KVCache(noise.to(DEVICE, dtype)), tables


def check(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0, window=None):
    q, kv, cache, tables = random_step(
        query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed
    )
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE, "triton")
    assert meta.backend == "triton" and meta.block_table is not None
    out = paged_attention(q, kv, cache, meta, SCALE, window)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(cache.kv[meta.slot_mapping], kv)  # the step's K/V landed
    expected = ref_attention(
        q.cpu(), cache.kv.cpu(), query_lens, seq_lens, tables, block_size, window
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


GQA = [(4, 4), (6, 2), (8, 2)]  # query heads per kv head: 1, 3, 4


@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size"), [(4, 4, 16), (6, 2, 16), (8, 2, 16), (6, 2, 1)]
)
def test_decode_ragged_lengths(heads: int, kv_heads: int, block_size: int) -> None:
    lens = [1, 17, 70, 5, 33]  # one past and around the kernel's 32/64-key tiles
    check([1] * len(lens), lens, heads, kv_heads, 64, block_size, torch.float32)


@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_prefill_chunk_over_cached_prefix(heads: int, kv_heads: int) -> None:
    # positions 29..69: tiles start at the chunk's first row and at multiples of 16/64
    check([41], [70], heads, kv_heads, 64, 8, torch.float32)


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (8, 2)])
def test_mixed_decode_and_prefill_step(heads: int, kv_heads: int) -> None:
    # decodes between prefills: a whole prompt, a chunk after a prefix, a two-token chunk
    check([1, 20, 1, 9, 2], [30, 20, 3, 50, 6], heads, kv_heads, 64, 16, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_cache(dtype: torch.dtype) -> None:
    check([1, 12, 1], [40, 12, 9], 8, 2, 128, 16, dtype)


def test_head_dim_128_fp32() -> None:
    check([1, 6], [20, 30], 4, 4, 128, 16, torch.float32)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_sliding_window(heads: int, kv_heads: int) -> None:
    """Decodes past the window, a chunk after a prefix and a whole prompt. With one query
    head per kv head and head_dim 128 a prefill tile is 64 rows over 32-key tiles: its later
    rows see no key of the first key tile (an all -inf row, which must not become NaN)."""
    check([1, 41, 1, 70], [70, 70, 9, 70], heads, kv_heads, 128, 16, torch.float32, window=5)
    check([1, 20, 1], [33, 20, 3], heads, kv_heads, 64, 4, torch.float32, window=16)


@pytest.mark.parametrize("shared_request", [False, True])
def test_padded_rows_read_a_scratch_block(shared_request: bool) -> None:
    """Rows that pad a batch (as a captured CUDA graph runs it) point at a scratch block at
    position 0: a softmax over one key, the scratch slot's V. Real rows are unaffected,
    whether each padded row has a block-table row of its own or all share one."""
    heads, kv_heads, head_dim, block_size, scratch = 8, 2, 64, 16, 0
    query_lens, seq_lens = [1, 1, 1], [21, 3, 40]
    q, kv, cache, tables = random_step(
        query_lens, seq_lens, heads, kv_heads, head_dim, block_size, torch.float32
    )
    num_padded = 3
    pad_requests = [3] * num_padded if shared_request else [3, 4, 5]
    padded_tables = tables + [[scratch]] * (max(pad_requests) - 2)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE, "triton")
    assert meta.block_table is not None and meta.token_request is not None
    assert meta.token_position is not None
    width = meta.block_table.shape[1]
    table = [t + [scratch] * (width - len(t)) for t in padded_tables]
    requests = meta.token_request.tolist() + pad_requests
    positions = meta.token_position.tolist() + [0] * num_padded
    q_padded = torch.cat([q, torch.randn(num_padded, heads, head_dim, device=DEVICE)])
    cache.kv.index_copy_(0, meta.slot_mapping, kv)
    out = triton_attention.paged_attention(
        q_padded,
        cache.kv,
        torch.tensor(table, dtype=torch.int32, device=DEVICE),
        torch.tensor(requests, dtype=torch.int32, device=DEVICE),
        torch.tensor(positions, dtype=torch.int32, device=DEVICE),
        block_size,
        SCALE,
    )
    expected = ref_attention(q.cpu(), cache.kv.cpu(), query_lens, seq_lens, tables, block_size)
    torch.testing.assert_close(out[:3].cpu().double(), expected, atol=1e-5, rtol=1e-5)
    scratch_v = cache.kv[scratch * block_size, 1].repeat_interleave(heads // kv_heads, 0)
    for row in range(3, 3 + num_padded):
        torch.testing.assert_close(out[row], scratch_v)


def test_backend_resolution() -> None:
    """ "triton" on a GPU, or on a CPU under the interpreter; "auto" picks it on CUDA only."""
    assert resolve_attention_backend("triton", DEVICE, torch.float32) == "triton"
    assert resolve_attention_backend("triton", DEVICE, torch.bfloat16) == "triton"
    assert resolve_attention_backend("auto", "cuda", torch.bfloat16) == "triton"
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) == "sdpa"


def test_greedy_tokens_equal_sdpa(tiny_llama_dir: Path) -> None:
    """The whole engine on the Triton backend against SDPA in fp32: chunked prompts,
    decodes beside prefills and a prefix-cache hit give the same greedy tokens."""
    from modelship import LLM, SamplingParams

    prompts = ["The quick brown fox", "Paged attention reads keys and values through", "Mod"]
    prompts.append(prompts[1] + " a block table")  # a prefix-cache hit on full blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("sdpa", "triton"):
        llm = LLM(
            tiny_llama_dir,
            device=DEVICE,
            dtype="float32",
            kv_cache_dtype="float32",
            attention_backend=backend,
            block_size=4,
            num_kv_blocks=64,
            max_prefill_chunk=5,
        )
        assert llm.engine.runner.attention_backend == backend
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["sdpa"]


# Compiles both launches, with and without a window, for an H100 (sm_90) with the wheel's
# ptxas, no GPU needed: what the interpreter never checks (tl.dot's minimum sizes, layouts,
# shared memory).
_COMPILE_SM90 = """
import itertools, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from modelship.model import triton_attention as ta

kernel = ta._paged_attention_kernel
types = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16", "scale_log2": "fp32"}
types.update({name: "*i32" for name in ("block_table_ptr", "token_request_ptr",
                                         "token_position_ptr")})
for launch, window in itertools.product(ta.launch_configs(4, 128, 16, torch.bfloat16), (0, 4096)):
    constexprs = {k: v for k, v in launch.items() if k != "num_warps"} | {"WINDOW": window}
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32")
                 for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch["num_warps"]})
    assert compiled.metadata.shared <= 228 * 1024, compiled.metadata.shared
"""


def test_compiles_for_sm90() -> None:
    ptxas = Path(sys.modules["triton"].__file__).parent / "backends/nvidia/bin/ptxas"
    if not ptxas.exists():
        pytest.skip("this triton wheel has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9 warns while unset
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
