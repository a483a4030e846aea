"""Torch threads per engine step, chosen by the step's token count (CPU).

A decode step of one sequence on a small model is a few hundred short parallel regions
(a 576 x 576 int4 matmul takes tens of microseconds); on a 2-core machine the second thread
can cost more in wake-ups and barriers than it saves, while prefill and large batches
divide well. `EngineConfig.step_threads` sets the thread count per step size; measured
trade-offs are in docs/performance.md ("Threads per step"). Every CPU kernel on the serving
path computes each output in one order whatever the thread count (work is split by output
rows or blocks, never inside a reduction), so the choice changes time, never tokens
(`tests/engine/test_determinism.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_step_threads(rules: tuple[tuple[int, int], ...]) -> None:
    """Refuse pairs that are not (most tokens, threads) with both >= 1 and most tokens
    increasing; the message names `step_threads`."""
    previous = 0
    for rule in rules:
        if len(rule) != 2 or any(not isinstance(v, int) or v < 1 for v in rule):
            raise ValueError(f"step_threads: each entry is (most tokens, threads) >= 1, got {rule}")
        if rule[0] <= previous:
            raise ValueError(f"step_threads: most tokens must increase, got {rules}")
        previous = rule[0]


@dataclass(frozen=True)
class StepThreads:
    """The thread count each step runs with: the first rule whose most tokens the step
    fits, else `default` (the engine's threads when it started)."""

    rules: tuple[tuple[int, int], ...]
    default: int

    def threads_for(self, num_tokens: int | None) -> int:
        """Threads for a step of `num_tokens` (None: not a step, e.g. scoring)."""
        if num_tokens is not None:
            for most_tokens, threads in self.rules:
                if num_tokens <= most_tokens:
                    return threads
        return self.default

    def apply(self, num_tokens: int | None) -> None:
        """Set torch's (and so OpenMP's) thread count for work on this thread, where rules
        are set. Cheap when unchanged: the OpenMP pool is kept between calls."""
        if not self.rules:
            return
        threads = self.threads_for(num_tokens)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
