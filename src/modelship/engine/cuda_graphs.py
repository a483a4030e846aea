"""Decode steps replayed from captured graphs (CUDA graphs on a GPU).

Eager PyTorch spends more CPU launching a small model's decode step than the GPU spends
running it. A CUDA graph records the kernels of one forward pass once and replays them
with one launch, but only over the same tensors: so the decode step reads its inputs from
static buffers (input ids, positions, slots, block tables) sized for a ladder of batch
sizes, and a batch of B sequences runs on the graph of the next size up. The padding rows
point at a scratch KV block that the block manager never hands out (position 0, a slot
and a block-table row in that block), so their K/V writes and reads never touch a
sequence's blocks.

Only steps whose attention metadata is fixed by the batch size can be captured: backends
that read K/V through `block_table`, `token_request` and `token_position` (the CPU
kernel's fields). SDPA's decode metadata is shaped by each step's longest context, so it
is refused. How a forward pass is recorded sits behind `GraphCapturer`: `CudaGraphCapturer`
on a GPU, `EagerReplayCapturer` (it calls the forward again over the same buffers) so that
CPU tests exercise the buffers, padding and bucketing.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from modelship.engine.config import MAX_GRAPH_BATCH_SIZE
from modelship.model.attention import AttentionMetadata
from modelship.model.kv_cache import KVCache
from modelship.model.registry import CausalLM

if TYPE_CHECKING:
    from modelship.engine.scheduler import SchedulerOutput
    from modelship.engine.sequence import Sequence

logger = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, MAX_GRAPH_BATCH_SIZE)
GRAPH_CAPTURERS = ("cuda", "replay")
# Fields of AttentionMetadata the runner keeps in static buffers; any other tensor in a
# backend's decode metadata would go stale between replays.
_STATIC_FIELDS = ("slot_mapping", "block_table", "token_request", "token_position")

Forward = Callable[[], torch.Tensor]


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """The ladder's sizes below `max_batch_size`, then `max_batch_size` itself (<= 256)."""
    if not 1 <= max_batch_size <= MAX_GRAPH_BATCH_SIZE:
        raise ValueError(f"max graph batch size must be in [1, {MAX_GRAPH_BATCH_SIZE}]")
    return [size for size in GRAPH_BATCH_SIZES if size < max_batch_size] + [max_batch_size]


def graph_capture_error(backend: str, block_size: int, device: torch.device) -> str | None:
    """Why decode steps of this attention backend cannot be captured; None if they can.

    Capturable: the metadata has the four static fields, and every other field is the same
    for two decode batches of one size with different contexts (a graph keeps the values
    it was captured with, so they may follow from the batch size only)."""
    short = AttentionMetadata.build([1, 1], [1, 1], [[0], [0]], block_size, device, backend)
    long = AttentionMetadata.build(
        [1, 1],
        [2 * block_size + 1, block_size + 1],
        [[0, 1, 2], [3, 4]],
        block_size,
        device,
        backend,
    )
    missing = [name for name in _STATIC_FIELDS if getattr(short, name, None) is None]
    shaped = [
        field.name
        for field in dataclasses.fields(short)
        if field.name not in _STATIC_FIELDS
        and not _same(getattr(short, field.name), getattr(long, field.name))
    ]
    if missing or shaped:
        reasons = []
        if shaped:
            reasons.append(f"fields that follow the step's contexts ({', '.join(shaped)})")
        if missing:
            reasons.append(f"no {', '.join(missing)}")
        return (
            f"attention backend {backend!r} cannot run decode steps from graphs: its decode "
            f"metadata has {' and '.join(reasons)}; graphs need a backend that reads K/V "
            "through block tables (cpu, triton)"
        )
    if short.slot_mapping.dtype != torch.long:
        return f"attention backend {backend!r}: slot_mapping is {short.slot_mapping.dtype}"
    return None


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


class GraphCapturer(ABC):
    """Records a forward pass over static buffers and replays it.

    `capture(forward)` returns a replay: a call that runs `forward`'s work again on the
    buffers' current contents and returns its output. The output may be one static tensor
    that the next replay overwrites, so callers read it before replaying again.
    """

    @abstractmethod
    def capture(self, forward: Forward) -> Forward: ...

    def memory_used(self) -> int | None:
        """Device bytes in use now (to log what capture cost); None where not measured."""
        return None


class CudaGraphCapturer(GraphCapturer):
    """torch.cuda.CUDAGraph per batch size, all in one memory pool: capture the largest
    first and the smaller graphs reuse its memory. Warm-up runs before each capture
    (lazy initialization and allocator growth must not be recorded)."""

    def __init__(self, device: torch.device, num_warmups: int = 2) -> None:
        self.device = device
        self.num_warmups = num_warmups
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Forward) -> Forward:
        for _ in range(self.num_warmups):
            forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        torch.cuda.synchronize(self.device)

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    def memory_used(self) -> int | None:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free


class EagerReplayCapturer(GraphCapturer):
    """Remembers the forward and runs it again on replay: the graph runner's buffers,
    padding and bucketing on any device, without graphs (CPU tests)."""

    def capture(self, forward: Forward) -> Forward:
        forward()  # as the CUDA capturer's warm-up: a failing forward fails at capture
        return forward


def create_graph_capturer(kind: str, device: torch.device) -> GraphCapturer:
    """ "cuda" (CUDA graphs) or "replay" (eager, any device)."""
    if kind == "cuda":
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        return CudaGraphCapturer(device)
    if kind == "replay":
        return EagerReplayCapturer()
    raise ValueError(f"graph capturer {kind!r}; supported: {', '.join(GRAPH_CAPTURERS)}")


class DecodeGraphRunner:
    """Decode-only steps of up to `batch_sizes[-1]` sequences, replayed over static buffers.

    Call `capture()` once, after the KV cache is allocated and before the first step. A
    step may be replayed when every sequence runs exactly one token (`can_replay`); the
    model runner runs every other step eagerly. Padding rows write and read only
    `scratch_block`, which must be a KV block the block manager never hands out. Reads
    sequences, never changes them.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        *,
        block_size: int,
        max_model_len: int,
        max_batch_size: int,
        scratch_block: int,
        attention_backend: str,
        device: torch.device,
        capturer: GraphCapturer,
    ) -> None:
        error = graph_capture_error(attention_backend, block_size, device)
        if error is not None:
            raise ValueError(error)
        num_slots = kv_caches[0].kv.shape[0]
        if not 0 <= scratch_block < num_slots // block_size:
            raise ValueError(f"scratch block {scratch_block} is not in the KV cache")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.attention_backend = attention_backend
        self.device = device
        self.capturer = capturer
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        size = self.batch_sizes[-1]
        probe = AttentionMetadata.build([1], [1], [[0]], block_size, device, attention_backend)
        # Static inputs; padding rows (and every row until the first step) point at the
        # scratch block. Rows of `ids`: input ids, positions, slots ([3, size] int64, so a
        # step's values arrive in one copy).
        self.ids = torch.zeros((3, size), dtype=torch.long, device=device)
        self.ids[2].fill_(scratch_block * block_size)
        # [size, max_blocks_per_seq]; entries past a token's position are never read
        self.block_table = torch.full(
            (size, self.max_blocks_per_seq),
            scratch_block,
            dtype=probe.block_table.dtype,
            device=device,
        )
        # decode: token i is request i's only token
        self.token_request = torch.arange(size, dtype=probe.token_request.dtype, device=device)
        self.token_position = torch.zeros(size, dtype=probe.token_position.dtype, device=device)
        self._replays: dict[int, Forward] = {}
        self.num_replays: Counter[int] = Counter()  # replays by batch size

    def batch_size_for(self, num_seqs: int) -> int | None:
        """The captured size a batch of `num_seqs` pads to; None above the largest."""
        if num_seqs < 1:
            return None
        index = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[index] if index < len(self.batch_sizes) else None

    def can_replay(self, plan: SchedulerOutput) -> bool:
        """Decode-only (one token per sequence) and no larger than the largest graph."""
        return self.batch_size_for(len(plan.scheduled)) is not None and all(
            scheduled.num_new_tokens == 1 for scheduled in plan.scheduled
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Record the forward at every batch size, largest first (smaller graphs reuse the
        pool's memory); logs the time and device memory it took."""
        start, before = time.perf_counter(), self.capturer.memory_used()
        for size in reversed(self.batch_sizes):
            self._replays[size] = self.capturer.capture(self._forward(size))
        after = self.capturer.memory_used()
        memory = "" if before is None or after is None else f", {(after - before) / 2**20:.0f} MiB"
        logger.info(
            "captured decode steps (%s) for batch sizes %s in %.2f s%s",
            type(self.capturer).__name__,
            self.batch_sizes,
            time.perf_counter() - start,
            memory,
        )

    def _forward(self, size: int) -> Forward:
        # the backend's own metadata for `size` one-token requests, its index tensors
        # swapped for views of the static buffers (other fields follow from the size)
        template = AttentionMetadata.build(
            [1] * size,
            [1] * size,
            [[self.scratch_block]] * size,
            self.block_size,
            self.device,
            self.attention_backend,
        )
        meta = dataclasses.replace(
            template,
            slot_mapping=self.ids[2, :size],
            block_table=self.block_table[:size],
            token_request=self.token_request[:size],
            token_position=self.token_position[:size],
        )
        input_ids, positions = self.ids[0, :size], self.ids[1, :size]
        return lambda: self.model(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def replay(self, seqs: list[Sequence]) -> torch.Tensor:  # [len(seqs), hidden]
        """Run each sequence's token at `num_computed_tokens`; the hidden states in order.
        The result is a view the next replay overwrites."""
        size = self.batch_size_for(len(seqs))
        if size is None or size not in self._replays:
            raise ValueError(f"no captured graph for a batch of {len(seqs)} (capture first?)")
        block_size, scratch = self.block_size, self.scratch_block
        ids, positions, slots, tables = [], [], [], []
        for seq in seqs:
            position = seq.num_computed_tokens
            table = seq.block_table[: position // block_size + 1]
            ids.append(seq.token_ids[position])
            positions.append(position)
            slots.append(table[-1] * block_size + position % block_size)
            tables.append(table)
        width = max(map(len, tables))
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a position past max_model_len ({width} blocks)")
        num_padding = size - len(seqs)
        rows = [table + [scratch] * (width - len(table)) for table in tables]
        rows += [[scratch] * width] * num_padding
        values = [
            ids + [0] * num_padding,
            positions + [0] * num_padding,
            slots + [scratch * block_size] * num_padding,
        ]
        self.ids[:, :size].copy_(torch.tensor(values))
        self.token_position[:size].copy_(self.ids[1, :size])
        # -1: a block freed outside the window (never read); any valid id stands in
        self.block_table[:size, :width].copy_(torch.tensor(rows).clamp_(min=0))
        self.block_table[:size, width:].fill_(scratch)
        hidden = self._replays[size]()  # [size, hidden]
        self.num_replays[size] += 1
        return hidden[: len(seqs)]
