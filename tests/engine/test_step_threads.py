"""`EngineConfig.step_threads`: each step runs on the thread count its token count picks
(`engine.step_threads`); that the tokens stay the same bitwise is checked on the demo
model in `test_determinism.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelship.engine import LLM, EngineConfig, SamplingParams
from modelship.engine.step_threads import AdaptiveThreads


def test_each_step_runs_on_the_threads_its_size_picks(tiny_llama_dir: Path) -> None:
    llm = LLM(tiny_llama_dir, num_threads=2, step_threads=((1, 1),))
    seen: list[tuple[int, int]] = []  # (the step's tokens, threads while the model ran)
    llm.engine.worker.model.register_forward_pre_hook(
        lambda _, args: seen.append((args[0].shape[0], torch.get_num_threads()))
    )
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([5, 6, 7, 8, 9], params)  # a 5-token prefill, then 2 decode steps
    llm.generate([[5, 6], [7, 8]], params)  # a 4-token prefill, then 2 steps of 2 rows
    assert seen == [(5, 2), (1, 1), (1, 1), (4, 2), (2, 2), (2, 2)]


def test_step_threads_refuses_rules_out_of_order() -> None:
    with pytest.raises(ValueError, match="step_threads: most tokens must increase"):
        EngineConfig(step_threads=((4, 1), (2, 2)))
    with pytest.raises(ValueError, match=r"step_threads: each entry is \(most tokens, threads\)"):
        EngineConfig(step_threads=((1, 0),))


def _run(adaptive: AdaptiveThreads, num_tokens: int, steps: int, seconds: dict[int, float]):
    """`steps` steps of `num_tokens`, each taking `seconds[threads]` per token; the thread
    counts picked, in order."""
    picked = []
    for _ in range(steps):
        threads = adaptive.threads_for(num_tokens)
        adaptive.record(num_tokens, threads, seconds[threads] * num_tokens)
        picked.append(threads)
    return picked


def test_adaptive_threads_settle_on_the_faster_count_and_probe_less_and_less() -> None:
    adaptive = AdaptiveThreads(2)
    picked = _run(adaptive, 1, 100, {1: 0.012, 2: 0.008})  # an idle host: 2 threads win
    assert picked[:2] == [1, 2]  # one step on each first
    # then the loser is timed again (one step) after 16 steps, then 32 more, then 64 more
    assert [i for i, t in enumerate(picked) if t == 1 and i >= 2] == [16, 49]


def test_adaptive_threads_follow_a_host_that_gets_busy_then_quiet() -> None:
    adaptive = AdaptiveThreads(2)
    _run(adaptive, 1, 40, {1: 0.012, 2: 0.008})
    busy = _run(adaptive, 1, 60, {1: 0.012, 2: 1.2})  # another process takes a core
    assert busy[-20:] == [1] * 20
    # two steps until the median of the latest three notices, then the probe due at 49
    assert busy.count(2) == 2 + 1
    quiet = _run(adaptive, 1, 200, {1: 0.012, 2: 0.008})
    assert quiet[-20:] == [2] * 20


def test_adaptive_threads_time_each_step_size_apart() -> None:
    adaptive = AdaptiveThreads(2)
    _run(adaptive, 1, 30, {1: 0.012, 2: 0.008})
    _run(adaptive, 16, 30, {1: 0.004, 2: 0.006})
    assert adaptive.threads_for(1) == 2
    assert adaptive.threads_for(16) == 1
    assert adaptive.threads_for(31) == 1  # 16-31 tokens: one group


def test_adaptive_threads_keep_the_tokens_and_use_both_counts(tiny_llama_dir: Path) -> None:
    """`adaptive_threads` times steps on 1 and 2 threads: the greedy tokens and logprobs
    are those of 2 threads throughout."""
    prompts = [[5, 6, 7, 8, 9], [7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    fixed = LLM(tiny_llama_dir, num_threads=2).generate(prompts, params)
    llm = LLM(tiny_llama_dir, num_threads=2, adaptive_threads=True)
    seen: set[int] = set()
    llm.engine.worker.model.register_forward_pre_hook(lambda *_: seen.add(torch.get_num_threads()))
    adaptive = llm.generate(prompts, params)
    assert seen == {1, 2}
    for a, b in zip(adaptive, fixed, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
