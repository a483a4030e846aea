"""`EngineConfig.step_threads`: each step runs on the thread count its token count picks
(`engine.step_threads`); that the tokens stay the same bitwise is checked on the demo
model in `test_determinism.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelship.engine import LLM, EngineConfig, SamplingParams


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
