"""Decode steps through the graph runner (`engine/cuda_graphs.py`), on CPU with eager replay.

`cuda_graphs="replay"` runs the same static buffers, padding and bucketing as CUDA graphs
with the forward called again instead of a graph replayed, so these tests check everything
but the capture itself: the same greedy tokens as eager steps, padding rows confined to the
scratch block, bucket choice, eager prefill and mixed steps, prefix caching.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import typer

from modelship import LLM, SamplingParams
from modelship.cli.serve import app as serve_app
from modelship.engine.config import EngineConfig
from modelship.engine.cuda_graphs import (
    DecodeGraphRunner,
    EagerReplayCapturer,
    graph_batch_sizes,
    graph_capture_error,
)
from modelship.engine.options import EngineOptions
from modelship.engine.scheduler import ScheduledSequence, SchedulerOutput
from modelship.engine.sequence import Sequence
from modelship.model import cpu_kernels
from modelship.model.attention import ATTENTION_BACKENDS, AttentionMetadata
from modelship.model.kv_cache import KVCache

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="needs AVX2 and a compiler")

BLOCK = 4
PROMPTS = [
    "The quick brown fox",
    "Paged attention reads blocks through a table",
    "Héllo wörld 東京",
    "Models are",
    "Continuous batching schedules requests at iteration granularity.",
]
CPU = torch.device("cpu")


def make_llm(model_dir: Path, cuda_graphs: bool | str, **config) -> LLM:
    settings = dict(
        dtype="float32", block_size=BLOCK, num_kv_blocks=96, max_num_seqs=8, max_model_len=128
    )
    settings.update(config)
    return LLM(model_dir, cuda_graphs=cuda_graphs, **settings)


def greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def graphs(llm: LLM) -> DecodeGraphRunner:
    runner = llm.engine.runner.graph_runner
    assert runner is not None
    return runner


def wrap_execute(llm: LLM, check: Callable) -> None:
    """Call `check(plan, replayed, before)` after each step; `before` is the KV cache then."""
    runner = llm.engine.runner
    execute = runner.execute

    def checked(plan, generators):
        before = [cache.kv.clone() for cache in runner.kv_caches]
        replays = graphs(llm).num_replays.total()
        output = execute(plan, generators)
        check(plan, graphs(llm).num_replays.total() > replays, before)
        return output

    runner.execute = checked


# Same tokens as eager -------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("num_requests", [3, 5])
def test_greedy_with_graphs_equals_eager(tiny_llama_dir: Path, num_requests: int) -> None:
    """Different lengths: the batch shrinks step by step through padded sizes (5 -> 8,
    3 -> 4, 2, 1), and every replayed token is the eager step's token."""
    prompts = PROMPTS[:num_requests]
    params = [greedy(4 + 5 * i, logprobs=0) for i in range(num_requests)]
    eager = make_llm(tiny_llama_dir, False, attention_backend="cpu").generate(prompts, params)
    llm = make_llm(tiny_llama_dir, "replay", attention_backend="cpu")
    replayed = llm.generate(prompts, params)
    for ours, theirs in zip(replayed, eager, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        ours_lp = [entry.logprob for entry in ours.outputs[0].logprobs]
        theirs_lp = [entry.logprob for entry in theirs.outputs[0].logprobs]
        assert ours_lp == pytest.approx(theirs_lp, abs=1e-4)
    padded = {5: 8, 3: 4}[num_requests]
    assert graphs(llm).num_replays[padded] > 0
    assert set(graphs(llm).num_replays) == {1, 2, 4} | {padded}


def test_greedy_with_graphs_equals_eager_on_triton(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA backend's metadata through the same buffers, on CPU tensors under Triton's
    interpreter (three short requests, padded to 4). Runs where TRITON_INTERPRET=1 is set
    before triton is first imported: in the environment, or by collecting
    tests/model/test_triton_attention.py (transformers imports triton in the fixture)."""
    if "triton" not in ATTENTION_BACKENDS:
        pytest.skip("no triton attention backend")
    # Triton reads it when it decorates kernels, its own included
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    settings = dict(attention_backend="triton", max_num_seqs=4, max_model_len=64)
    prompts = PROMPTS[:3]
    params = [greedy(3 + 2 * i) for i in range(3)]
    try:
        eager = make_llm(tiny_llama_dir, False, **settings).generate(prompts, params)
    except (ValueError, RuntimeError) as exc:  # the kernel module was imported compiled
        pytest.skip(f"triton backend unavailable on CPU here: {exc}")
    llm = make_llm(tiny_llama_dir, "replay", **settings)
    replayed = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in replayed] == [o.outputs[0].token_ids for o in eager]
    assert set(graphs(llm).num_replays) == {4, 2, 1}


def test_sdpa_is_refused_by_name(tiny_llama_dir: Path) -> None:
    """SDPA's decode metadata is shaped by the step's longest context: no graph can hold it."""
    assert graph_capture_error("cpu", BLOCK, CPU) is None
    error = graph_capture_error("sdpa", BLOCK, CPU)
    assert error is not None and "'sdpa'" in error and "decode_slots" in error
    with pytest.raises(ValueError, match="attention backend 'sdpa' cannot run decode steps"):
        make_llm(tiny_llama_dir, "replay", attention_backend="sdpa")
    # graphs left on by default are off on CPU: sdpa serves eagerly
    llm = make_llm(tiny_llama_dir, True, attention_backend="sdpa")
    assert llm.engine.runner.graph_runner is None
    assert len(llm.generate(PROMPTS[0], greedy(3))[0].outputs[0].token_ids) == 3


def test_metadata_that_follows_the_contexts_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph keeps the values it was captured with: a backend whose metadata carries,
    say, the longest context as a launch bound cannot be replayed."""
    build = AttentionMetadata.build

    def with_launch_bound(query_lens, seq_lens, block_tables, block_size, device, backend):
        meta = build(query_lens, seq_lens, block_tables, block_size, device, "cpu")
        return dataclasses.replace(meta, num_decode=max(seq_lens))

    monkeypatch.setattr(AttentionMetadata, "build", staticmethod(with_launch_bound))
    error = graph_capture_error("bounded", BLOCK, CPU)
    assert error is not None and "(num_decode)" in error


# Padding stays in the scratch block -----------------------------------------------------------
@needs_kernels
def test_padding_writes_only_the_scratch_block(tiny_llama_dir: Path) -> None:
    llm = make_llm(tiny_llama_dir, "replay", attention_backend="cpu")
    engine = llm.engine
    scratch = graphs(llm).scratch_block
    assert scratch == engine.block_manager.num_blocks  # one block past what it hands out
    scratch_slots = set(range(scratch * BLOCK, (scratch + 1) * BLOCK))
    padded_steps = []

    def check(plan: SchedulerOutput, replayed: bool, before: list[torch.Tensor]) -> None:
        written = set()
        for scheduled in plan.scheduled:
            seq, start = scheduled.seq, scheduled.seq.num_computed_tokens
            assert scratch not in seq.block_table
            for p in range(start, start + scheduled.num_new_tokens):
                written.add(seq.block_table[p // BLOCK] * BLOCK + p % BLOCK)
        engine.block_manager.check_integrity()
        padded = replayed and len(plan.scheduled) not in graphs(llm).batch_sizes
        for old, cache in zip(before, engine.kv_caches, strict=True):
            changed = set((old != cache.kv).flatten(1).any(1).nonzero().flatten().tolist())
            assert changed - written <= scratch_slots
            if padded:
                assert changed & scratch_slots  # the padding went somewhere: here
        if padded:
            padded_steps.append(len(plan.scheduled))
        mark_scratch()

    def mark_scratch() -> None:  # padding writes the same K/V every step: make it show
        for cache in engine.kv_caches:
            cache.kv[scratch * BLOCK : (scratch + 1) * BLOCK] = 1e4

    mark_scratch()
    wrap_execute(llm, check)
    llm.generate(PROMPTS, [greedy(3 + 4 * i) for i in range(len(PROMPTS))])
    assert {3, 5} <= set(padded_steps)


@needs_kernels
def test_replay_matches_the_eager_forward_and_keeps_real_blocks(tiny_llama_dir: Path) -> None:
    """Three sequences (padded to 4) over a cache full of other requests' K/V: the same
    hidden states as an eager forward, and only their three new slots and the scratch
    block change."""
    llm = make_llm(tiny_llama_dir, "replay", attention_backend="cpu")
    runner, caches = graphs(llm), llm.engine.kv_caches
    torch.manual_seed(0)
    for cache in caches:
        cache.kv.normal_()
    contexts = [(5, [7, 3]), (9, [0, 11, 4]), (1, [20])]  # (position, block table)
    seqs = []
    for i, (position, table) in enumerate(contexts):
        seq = Sequence(f"s{i}", list(range(10 + i, 11 + i + position)), greedy(1))
        seq.num_computed_tokens, seq.block_table = position, table
        seqs.append(seq)

    snapshot = [cache.kv.clone() for cache in caches]
    expected = llm.engine.model(
        torch.tensor([s.token_ids[s.num_computed_tokens] for s in seqs]),
        torch.tensor([s.num_computed_tokens for s in seqs]),
        [KVCache(kv) for kv in snapshot],
        AttentionMetadata.build(
            [1] * 3,
            [s.num_computed_tokens + 1 for s in seqs],
            [s.block_table for s in seqs],
            BLOCK,
            CPU,
            "cpu",
        ),
    )
    before = [cache.kv.clone() for cache in caches]
    hidden = runner.replay(seqs)
    assert runner.num_replays == {4: 1}
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    written = {table[p // BLOCK] * BLOCK + p % BLOCK for p, table in contexts}
    scratch = range(runner.scratch_block * BLOCK, (runner.scratch_block + 1) * BLOCK)
    for old, cache, reference in zip(before, caches, snapshot, strict=True):
        changed = set((old != cache.kv).flatten(1).any(1).nonzero().flatten().tolist())
        assert changed - written <= set(scratch)
        # the eager pass wrote the same K/V into the real slots
        torch.testing.assert_close(cache.kv[: scratch.start], reference[: scratch.start])


# Buckets ----------------------------------------------------------------------------------------
class StubModel:
    """Returns row i = input id i, and keeps each call's inputs."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        self.calls.append(
            tuple(t.clone() for t in (input_ids, positions, meta.slot_mapping, meta.block_table))
        )
        return input_ids.float()[:, None].repeat(1, 2)


def stub_runner(max_batch_size: int, num_blocks: int = 8) -> tuple[DecodeGraphRunner, StubModel]:
    model = StubModel()
    caches = [KVCache(torch.zeros(num_blocks * BLOCK, 2, 1, 1))]
    runner = DecodeGraphRunner(
        model,  # type: ignore[arg-type]
        caches,
        block_size=BLOCK,
        max_model_len=32,
        max_batch_size=max_batch_size,
        scratch_block=num_blocks - 1,
        attention_backend="cpu",
        device=CPU,
        capturer=EagerReplayCapturer(),
    )
    return runner, model


def decode_plan(num_seqs: int, num_new_tokens: int = 1) -> SchedulerOutput:
    """`num_seqs` one-token steps, the last one running `num_new_tokens`."""
    seqs = [Sequence(str(i), [1, 2, 3], greedy(1)) for i in range(num_seqs)]
    counts = [1] * (num_seqs - 1) + [num_new_tokens]
    return SchedulerOutput([ScheduledSequence(s, n) for s, n in zip(seqs, counts, strict=True)])


def test_bucket_choice() -> None:
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_batch_sizes(1) == [1]
    with pytest.raises(ValueError):
        graph_batch_sizes(257)
    assert EngineConfig(max_num_seqs=1000).max_graph_batch_size == 256
    assert EngineConfig(max_num_seqs=24).max_graph_batch_size == 24
    assert EngineConfig(cuda_graph_max_batch_size=16).max_graph_batch_size == 16
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size"):
        EngineConfig(cuda_graph_max_batch_size=257)

    runner, model = stub_runner(256)
    runner.capture()
    # captured largest first, one forward per size
    assert [len(call[0]) for call in model.calls] == [256, 128, 64, 32, 16, 8, 4, 2, 1]
    assert runner.batch_size_for(3) == 4
    assert runner.batch_size_for(4) == 4
    assert runner.batch_size_for(200) == 256
    assert runner.batch_size_for(256) == 256
    assert runner.batch_size_for(257) is None
    assert runner.can_replay(decode_plan(3))
    assert runner.can_replay(decode_plan(256))
    assert not runner.can_replay(decode_plan(257))  # above the cap: eager
    assert not runner.can_replay(decode_plan(3, num_new_tokens=2))  # a prefill among them


def test_padding_rows_point_at_the_scratch_block() -> None:
    runner, model = stub_runner(8)
    runner.capture()
    seqs = []
    for i, (position, table) in enumerate([(6, [2, 5]), (0, [3]), (2, [6])]):
        seq = Sequence(str(i), [40 + i] * (position + 1), greedy(1))
        seq.num_computed_tokens, seq.block_table = position, table
        seqs.append(seq)
    # a larger batch first, so the buffers hold stale rows where padding goes next
    runner.replay([*seqs, *seqs[:2]])
    hidden = runner.replay(seqs)  # padded to 4
    assert hidden[:, 0].tolist() == [40, 41, 42]
    input_ids, positions, slots, table = model.calls[-1]
    scratch = runner.scratch_block
    assert input_ids.tolist() == [40, 41, 42, 0]
    assert positions.tolist() == [6, 0, 2, 0]
    assert slots.tolist() == [5 * BLOCK + 2, 3 * BLOCK, 6 * BLOCK + 2, scratch * BLOCK]
    assert table.shape == (4, 32 // BLOCK)
    assert table[:, 0].tolist() == [2, 3, 6, scratch] and table[0, 1] == 5
    assert (table[0, 2:] == scratch).all() and (table[1:, 1:] == scratch).all()
    assert runner.num_replays == {8: 1, 4: 1}


# Eager steps ------------------------------------------------------------------------------------
@needs_kernels
def test_prefill_mixed_and_oversized_steps_run_eagerly(tiny_llama_dir: Path) -> None:
    llm = make_llm(tiny_llama_dir, "replay", attention_backend="cpu", cuda_graph_max_batch_size=2)
    assert graphs(llm).batch_sizes == [1, 2]
    steps: list[tuple[str, bool]] = []

    def check(plan: SchedulerOutput, replayed: bool, before) -> None:
        counts = {s.num_new_tokens == 1 for s in plan.scheduled}
        kind = {frozenset({True}): "decode", frozenset({False}): "prefill"}.get(
            frozenset(counts), "mixed"
        )
        if kind == "decode" and len(plan.scheduled) > 2:
            kind = "oversized"
        steps.append((kind, replayed))

    wrap_execute(llm, check)
    engine = llm.engine
    engine.add_request("a", PROMPTS[1], greedy(6))
    engine.step()  # a's prompt
    engine.step()  # a decodes
    engine.add_request("b", PROMPTS[4], greedy(6))  # b's and c's prompts share a step
    engine.add_request("c", PROMPTS[0], greedy(6))  # with a's decode, then three decode
    while engine.has_unfinished():
        engine.step()
    assert {kind for kind, _ in steps} == {"decode", "prefill", "mixed", "oversized"}
    for kind, replayed in steps:
        assert replayed == (kind == "decode"), steps


# Prefix caching ---------------------------------------------------------------------------------
@needs_kernels
def test_prefix_cache_hits_with_graphs(tiny_llama_dir: Path) -> None:
    prompt = "Continuous batching schedules requests at iteration granularity. " * 2
    params = greedy(8)
    expected = make_llm(tiny_llama_dir, False).generate(prompt, params)[0].outputs[0].token_ids
    llm = make_llm(tiny_llama_dir, "replay")
    first = llm.generate(prompt, params)[0]
    replays = graphs(llm).num_replays.total()
    second = llm.generate(prompt, params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= len(second.prompt_token_ids) - BLOCK
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected
    assert graphs(llm).num_replays.total() > replays
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@needs_kernels
def test_preempted_sequences_resume_the_same_with_graphs(tiny_llama_dir: Path) -> None:
    """Block tables change under preemption and recompute; each step's buffers follow."""
    settings = dict(num_kv_blocks=24, max_num_batched_tokens=64, attention_backend="cpu")
    params = greedy(30)
    eager = make_llm(tiny_llama_dir, False, **settings).generate(PROMPTS[:3], params)
    llm = make_llm(tiny_llama_dir, "replay", **settings)
    replayed = llm.generate(PROMPTS[:3], params)
    assert llm.engine.scheduler.num_preemptions > 0  # 3 x ~40 tokens > 24 blocks x 4
    assert graphs(llm).num_replays.total() > 0
    for ours, theirs in zip(replayed, eager, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids


# Switches ---------------------------------------------------------------------------------------
def test_switches() -> None:
    assert EngineConfig().graph_capturer is None  # on by default, but CPU has no CUDA graphs
    assert EngineConfig(device="cuda").graph_capturer == "cuda"
    assert EngineConfig(device="cuda", cuda_graphs=False).graph_capturer is None
    assert EngineConfig(cuda_graphs="replay").graph_capturer == "replay"
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")  # type: ignore[arg-type]

    options = EngineOptions(cuda_graphs=False, cuda_graph_max_batch_size=32)
    config = options.to_engine_config()
    assert (config.cuda_graphs, config.cuda_graph_max_batch_size) == (False, 32)
    command = typer.main.get_command(serve_app)
    for opts in (options, EngineOptions()):
        context = command.make_context("serve", ["model", *opts.cli_args()])
        assert context.params["cuda_graphs"] is opts.cuda_graphs
        assert context.params["cuda_graph_max_batch_size"] == opts.cuda_graph_max_batch_size
