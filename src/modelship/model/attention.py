"""Paged attention over the flat KV cache: modelship's CPU kernel, Triton on CUDA, or SDPA.

On an AVX2 CPU with an fp32 cache (the default there) or an int8 one (`KVCache.scales`;
the kernel quantizes on write and dequantizes in its dot products) every token of the step,
decode and prefill alike, goes through one kernel call per layer: the model calls
`cpu_kernels.rope_paged_attention` (RoPE, the K/V write, then attention);
`paged_attention` below takes the same metadata for already-rotated q/k. The kernel reads
K/V through the block tables in place and visits each query's keys block by block in
position order, so a query's result does not depend on the rest of the batch or on how
its prompt was chunked or cached (deterministic greedy decoding). On CUDA the Triton kernel
(`triton_attention.py`) takes the same metadata, moved to the GPU, and reads K/V in place
the same way; its launches depend on the number of tokens only, so a step can be captured
in a CUDA graph and replayed for any context lengths. Elsewhere, SDPA:

Measured on a 2-core CPU: fp32 `scaled_dot_product_attention(..., enable_gqa=True)` is fast
and exact for decode, bf16 SDPA is several times slower, and repeating KV heads costs more
than it saves. So attention runs in the KV cache's dtype (fp32 on CPU by default; an int8
or fp8 cache is dequantized to fp32 as it is gathered): all
decode requests (one query token) in one batched SDPA call over their gathered, padded
contexts, and each prefill chunk in its own call with a causal mask offset by the tokens
already computed. Everything index-like is built once per step in `AttentionMetadata.build`
and shared by all layers.

Sliding windows (`window`: Mistral v0.1, Gemma's local layers): a query at position p sees
positions p - window + 1 .. p. The kernels start at the window's first block (the blocks
before it may have gone back to the pool: `BlockManager` swaps them for -1 in a table,
which `build` reads as block 0, never dereferenced); SDPA adds the window to its masks,
built once per step and window. On CUDA, SDPA runs without its cuDNN backend, which plans anew for
every padded length it sees (78% of the CPU time of a decode step on an H100).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from modelship.model import cpu_kernels
from modelship.model.kv_cache import KVCache


@dataclass
class PrefillChunk:
    """One request running more than one query token this step."""

    start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    context_slots: torch.Tensor | None  # [seq_len] slots of the whole context; None: no prefix
    mask: torch.Tensor | None  # [num_tokens, seq_len] bool, True = attend; None: plain causal


@dataclass
class AttentionMetadata:
    """Where this step's tokens write K/V and which slots each query reads.

    Built once per step; read-only for the layers. `backend` says which fields are set:
    "cpu" and "triton" (the kernels' inputs, on the model's device for "triton") or "sdpa"
    (the rest). `decode_rows` is None when every token of the batch is a decode token (then
    the decode batch is the whole batch, in order).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_tokens: int
    num_decode: int
    decode_rows: torch.Tensor | None  # [num_decode] rows of single-token requests
    decode_slots: torch.Tensor | None  # [num_decode, max_len] context slots, padded with 0
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_len]; None: no padding
    prefills: list[PrefillChunk]
    decode_lens: torch.Tensor | None = None  # [num_decode] context lengths (SDPA, windows)
    # The CPU and Triton kernels' inputs (None on SDPA): blocks of each request
    # [num_requests, width] int32, and each token's request and position [num_tokens] int32.
    block_table: torch.Tensor | None = None
    token_request: torch.Tensor | None = None
    token_position: torch.Tensor | None = None
    block_size: int = 0
    backend: str = "sdpa"  # "cpu", "triton" or "sdpa"
    # SDPA's masks with a window, by window: (decode mask, one mask per prefill chunk)
    _window_masks: dict[int, tuple[torch.Tensor | None, list[torch.Tensor]]] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        backend: str = "sdpa",
    ) -> AttentionMetadata:
        """Request i runs `query_lens[i]` new tokens, the last ones of its `seq_lens[i]`.

        `block_tables[i]` must cover `seq_lens[i]` tokens; -1 stands for a block outside
        every layer's window (read as block 0, never attended to). Python work is per request and
        per block, never per token; index tensors are built on the CPU and moved once.
        `backend`: "cpu" (modelship's kernel; see the module docstring), "triton" (the same
        fields, on `device`: one transfer of the int32 ones, one of `slot_mapping`) or "sdpa".
        """
        num_requests = len(query_lens)
        if not num_requests or not len(seq_lens) == len(block_tables) == num_requests:
            raise ValueError("query_lens, seq_lens and block_tables must be equally long, > 0")
        num_blocks = [-(-s // block_size) for s in seq_lens]
        for i, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
            if not 0 < q <= s or len(table) < num_blocks[i]:
                raise ValueError(
                    f"request {i}: need 0 < query_len ({q}) <= seq_len ({s}) and a block "
                    f"table of at least {num_blocks[i]} blocks (has {len(table)})"
                )
        width = max(num_blocks)
        table = torch.tensor(
            [t[:n] + [0] * (width - n) for t, n in zip(block_tables, num_blocks, strict=True)]
        ).clamp_(min=0)
        # [num_requests, width * block_size]: slot of every context position of every request
        slots = (table.unsqueeze(-1) * block_size + torch.arange(block_size)).flatten(1)
        q_lens = torch.tensor(query_lens)
        s_lens = torch.tensor(seq_lens)
        num_tokens = sum(query_lens)
        request = torch.repeat_interleave(torch.arange(num_requests), q_lens)  # [num_tokens]
        first_row = torch.cumsum(q_lens, 0) - q_lens
        positions = torch.arange(num_tokens) - first_row[request] + (s_lens - q_lens)[request]
        slot_mapping = slots[request, positions]
        if backend in ("cpu", "triton"):
            # one int32 buffer: block table | token request | token position, moved at once
            packed = torch.cat([table.flatten(), request, positions]).to(torch.int32)
            packed = packed.to(device)
            block_table, token_request, token_position = packed.split(
                [table.numel(), num_tokens, num_tokens]
            )
            return cls(
                slot_mapping=slot_mapping.to(device),
                num_tokens=num_tokens,
                num_decode=0,
                decode_rows=None,
                decode_slots=None,
                decode_mask=None,
                prefills=[],
                block_table=block_table.view(table.shape),
                token_request=token_request,
                token_position=token_position,
                block_size=block_size,
                backend=backend,
            )
        if backend != "sdpa":
            raise ValueError(f"attention backend {backend!r}; supported: cpu, triton, sdpa")

        decode = [i for i, q in enumerate(query_lens) if q == 1]
        decode_rows = decode_slots = decode_mask = decode_lens = None
        if decode:
            lens = [seq_lens[i] for i in decode]
            max_len = max(lens)
            decode_lens = torch.tensor(lens).to(device)
            decode_slots = slots[decode, :max_len].to(device)
            if min(lens) != max_len:
                valid = torch.arange(max_len) < torch.tensor(lens).unsqueeze(1)
                decode_mask = valid[:, None, None, :].to(device)
            if len(decode) != num_requests:
                rows = first_row[decode]
                decode_rows = rows.to(device)

        prefills = []
        starts = itertools.accumulate(query_lens, initial=0)
        for i, (q, s, start) in enumerate(zip(query_lens, seq_lens, starts, strict=False)):
            if q == 1:
                continue
            if q == s:  # the whole context is in this step: causal over its own K/V
                prefills.append(PrefillChunk(start, q, None, None))
                continue
            query_positions = torch.arange(s - q, s).unsqueeze(1)  # [q, 1]
            mask = torch.arange(s).unsqueeze(0) <= query_positions  # [q, s]
            prefills.append(PrefillChunk(start, q, slots[i, :s].to(device), mask.to(device)))
        return cls(
            slot_mapping=slot_mapping.to(device),
            num_tokens=num_tokens,
            num_decode=len(decode),
            decode_rows=decode_rows,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefills,
            decode_lens=decode_lens,
        )

    def window_masks(self, window: int) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """SDPA's masks with a sliding window (True = attend), made at a layer's first ask
        and reused by the step's other layers with that window: the decode batch's
        [num_decode, 1, 1, max_len] (None without decode rows) and each prefill chunk's
        [num_tokens, seq_len]."""
        if window not in self._window_masks:
            decode = None
            if self.num_decode:
                assert self.decode_slots is not None and self.decode_lens is not None
                keys = torch.arange(self.decode_slots.shape[1], device=self.decode_slots.device)
                lens = self.decode_lens.unsqueeze(1)
                decode = ((keys < lens) & (keys >= lens - window))[:, None, None, :]
            chunks = []
            for chunk in self.prefills:
                device = self.slot_mapping.device
                slots = chunk.context_slots
                length = chunk.num_tokens if slots is None else len(slots)
                keys = torch.arange(length, device=device)
                queries = torch.arange(length - chunk.num_tokens, length, device=device)[:, None]
                chunks.append((keys <= queries) & (keys > queries - window))
            self._window_masks[window] = (decode, chunks)
        return self._window_masks[window]


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv: torch.Tensor,  # [num_tokens, 2, num_kv_heads, head_dim]: keys (rotated) and values
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] in q's dtype
    """Write this step's K/V into the cache at `meta.slot_mapping`, then let every query
    attend causally to its request's whole context (with `window`, to its last `window`
    positions), read through its block table."""
    out_dtype, work_dtype = q.dtype, cache.dtype  # fp32 for an int8/fp8 cache
    kv = kv.to(work_dtype)
    cache.write(meta.slot_mapping, kv)
    if meta.backend == "triton":
        from modelship.model import triton_attention

        assert meta.block_table is not None
        assert meta.token_request is not None and meta.token_position is not None
        return triton_attention.paged_attention(
            q,
            cache.kv,
            meta.block_table,
            meta.token_request,
            meta.token_position,
            meta.block_size,
            scale,
            window,
        )
    if meta.backend == "cpu":
        out = cpu_kernels.paged_attention(
            q.to(torch.float32).contiguous(),
            cache.kv,
            cache.scales,
            meta.block_table,
            meta.token_request,
            meta.token_position,
            meta.block_size,
            scale,
            window,
        )
        return out.to(out_dtype)
    q = q.to(work_dtype)
    with _sdpa_backends(q.device):
        return _sdpa(q, kv, cache, meta, scale, window).to(out_dtype)


def _sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA every SDPA backend but cuDNN's: it builds a new plan for every new padded
    context length, and measured on an H100 leaving it out nearly doubled throughput."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )


def _sdpa(
    q: torch.Tensor,  # [num_tokens, heads, head_dim] in the cache's dtype
    kv: torch.Tensor,  # [num_tokens, 2, kv_heads, head_dim], the step's K/V (written already)
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [num_tokens, heads, head_dim] in the cache's dtype
    """Decode requests in one batched SDPA call, each prefill chunk in its own."""
    decode_mask, chunk_masks = meta.decode_mask, [chunk.mask for chunk in meta.prefills]
    if window is not None:
        decode_mask, chunk_masks = meta.window_masks(window)
    if not meta.prefills:  # decode only: the common step, no scatter needed
        return _decode(q, cache, meta, scale, decode_mask)
    work_dtype = q.dtype
    out = torch.empty(q.shape, dtype=work_dtype, device=q.device)
    if meta.num_decode:
        assert meta.decode_rows is not None
        decode_q = q.index_select(0, meta.decode_rows)
        out[meta.decode_rows] = _decode(decode_q, cache, meta, scale, decode_mask)
    for chunk, mask in zip(meta.prefills, chunk_masks, strict=True):
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        if chunk.context_slots is None and cache.scales is None:  # whole prompt: K/V at hand
            context = kv[rows]
        elif chunk.context_slots is None:  # int8/fp8: attend to K/V as the cache holds them
            context = cache.read(meta.slot_mapping[rows])
        else:
            context = cache.read(chunk.context_slots)  # [seq_len, 2, kv_heads, dim]
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),  # [1, heads, num_tokens, head_dim]
            context[:, 0].transpose(0, 1).unsqueeze(0),  # [1, kv_heads, seq_len, head_dim]
            context[:, 1].transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out


def _decode(
    q: torch.Tensor,  # [num_decode, heads, head_dim]
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    mask: torch.Tensor | None,  # [num_decode, 1, 1, max_len] True = attend; None: all
) -> torch.Tensor:  # [num_decode, heads, head_dim]
    """One query token per request, all requests in one SDPA call over padded contexts."""
    assert meta.decode_slots is not None
    num_decode, max_len = meta.decode_slots.shape
    context = cache.read(meta.decode_slots.view(-1))
    context = context.view(num_decode, max_len, *cache.kv.shape[1:])  # [b, len, 2, kv_heads, d]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [num_decode, heads, 1, head_dim]
        context[:, :, 0].transpose(1, 2),  # [num_decode, kv_heads, max_len, head_dim]
        context[:, :, 1].transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(2)


ATTENTION_BACKENDS = ("auto", "cpu", "triton", "sdpa")


def resolve_attention_backend(
    backend: str, device: torch.device | str, cache_dtype: torch.dtype
) -> str:
    """ "auto" -> "cpu" on an AVX2 CPU with an fp32 or int8 cache (kernel built), "triton"
    on CUDA where triton imports and the cache is not quantized, else "sdpa" (an fp8 cache
    is read by SDPA only: the CPU kernel has no fp8 path). "triton" on a CPU only under
    TRITON_INTERPRET=1 (Triton's interpreter: slow, for tests)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend {backend!r}; supported: {', '.join(ATTENTION_BACKENDS)}"
        )
    device_type = torch.device(device).type
    if backend == "triton" or (backend == "auto" and device_type == "cuda"):
        return _resolve_triton(backend, device_type, cache_dtype)
    usable = device_type == "cpu" and cache_dtype in (torch.float32, torch.int8)
    if backend == "sdpa" or (backend == "auto" and not usable):
        return "sdpa"
    if not usable:
        raise ValueError(
            "the cpu attention backend needs a CPU device and an fp32 KV cache (or an int8 "
            f"one), got {cache_dtype}; an fp8 cache runs on the sdpa backend"
        )
    if not cpu_kernels.load():
        if backend == "cpu":
            raise RuntimeError("the cpu attention backend needs modelship's kernels (AVX2)")
        return "sdpa"
    return "cpu"


def _resolve_triton(backend: str, device_type: str, cache_dtype: torch.dtype) -> str:
    """ "triton" where it can run, "sdpa" for "auto" where it cannot; else a ValueError."""
    try:
        import triton  # noqa: F401  (only whether it imports)
    except ImportError:
        if backend == "auto":
            return "sdpa"
        raise ValueError(
            "the triton attention backend needs triton (CUDA builds of torch ship it; "
            "elsewhere: pip install triton)"
        ) from None
    if cache_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        if backend == "auto":
            return "sdpa"
        raise ValueError(
            f"the triton attention backend has no {cache_dtype} KV cache "
            "(float32, bfloat16, float16; an int8 cache runs on the cpu or sdpa backend, "
            "an fp8 one on sdpa)"
        )
    if device_type == "cuda":
        return "triton"
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        from modelship.model import triton_attention

        if not triton_attention.INTERPRETED:
            raise ValueError(
                "TRITON_INTERPRET=1 was set after triton (or modelship.model."
                "triton_attention) was first imported: set it before"
            )
        return "triton"
    raise ValueError(
        f"the triton attention backend needs a CUDA device (or, for tests on a CPU, "
        f"TRITON_INTERPRET=1); got {device_type}"
    )
