"""Torch threads per engine step, chosen by the step's token count (CPU): fixed rules
(`StepThreads`) or timed (`AdaptiveThreads`).

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

import statistics
from collections import deque
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
    fits; else, with `adaptive`, the count it picks; else `default` (the engine's threads
    when it started)."""

    rules: tuple[tuple[int, int], ...]
    default: int
    adaptive: AdaptiveThreads | None = None

    def threads_for(self, num_tokens: int | None) -> int:
        """Threads for a step of `num_tokens` (None: not a step, e.g. scoring)."""
        if num_tokens is not None:
            ruled = self._rule(num_tokens)
            if ruled is not None:
                return ruled
            if self._adapts(num_tokens):
                return self.adaptive.threads_for(num_tokens)
        return self.default

    def _rule(self, num_tokens: int) -> int | None:
        """The threads of the first rule the step fits, if any."""
        return next((threads for most, threads in self.rules if num_tokens <= most), None)

    def _adapts(self, num_tokens: int) -> bool:
        """Whether `adaptive` picks (and times) steps of this size: no rule covers it."""
        return self.adaptive is not None and num_tokens > 0 and self._rule(num_tokens) is None

    def apply(self, num_tokens: int | None) -> int:
        """Set torch's (and so OpenMP's) thread count for work on this thread, where rules
        are set or threads adapt, and return it. Cheap when unchanged: the OpenMP pool is
        kept between calls."""
        if not self.rules and self.adaptive is None:
            return self.default
        threads = self.threads_for(num_tokens)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """A step of `num_tokens` took `seconds` on `threads` (what `apply` returned)."""
        if self._adapts(num_tokens):
            self.adaptive.record(num_tokens, threads, seconds)


# Step sizes are grouped by their bit length (1, 2-3, 4-7, ... tokens), up to this group,
# which takes every larger step: within a group the per-token time is comparable.
_LARGEST_GROUP = 10
_SAMPLES = 3  # per candidate, the median of the latest is its estimate
_FIRST_PROBE = 16  # steps in a group before the losing candidate is timed again
_LAST_PROBE = 4096  # the probe interval doubles up to this while the loser keeps losing


@dataclass
class _Group:
    seconds: dict[int, deque]  # threads -> seconds per token of its latest steps
    steps: int = 0
    probing: int | None = None  # the losing candidate being timed again
    next_probe: int = _FIRST_PROBE
    interval: int = _FIRST_PROBE


class AdaptiveThreads:
    """Runs each step on one thread or on all of them, whichever the latest steps of its
    size ran faster (`EngineConfig.adaptive_threads`).

    On an idle 2-core machine two threads win (a batch-1 int4 decode step: 8.2 ms against
    11.9 ms on one); on a shared host where another process takes a core, a two-thread
    step waits at every OpenMP barrier for the descheduled thread and one thread wins by
    10-100x (docs/performance.md, "Adaptive threads"). Neither holds for a replica's whole
    life, so each step size keeps timing both: one step on each first, then a candidate's
    estimate is the median seconds per token of its latest (up to 3) steps, and the losing
    one is timed again (one step, which replaces its older times) after 16 steps of that
    size, then after twice as many each time it loses again (at most 4096), so a host that
    quiets down or gets busy is noticed while probing costs little. The kernels compute
    every output the same way on any thread count, so the choice changes time, never
    tokens."""

    def __init__(self, threads: int) -> None:
        self.candidates = (1, threads)
        self.groups: dict[int, _Group] = {}

    def threads_for(self, num_tokens: int) -> int:
        """The thread count for the next step of `num_tokens`."""
        group = self._group(num_tokens)
        if group.steps < len(self.candidates):  # first, one step on each
            return self.candidates[group.steps]
        best, other = self._ranked(group)
        if group.steps >= group.next_probe:
            group.probing = other
            group.seconds[other].clear()  # its times are stale: the host may have changed
            return other
        return best

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """A step of `num_tokens` ran on `threads` in `seconds`."""
        group = self._group(num_tokens)
        group.seconds[threads].append(seconds / num_tokens)
        group.steps += 1
        if group.probing == threads:
            group.probing = None
            if self._ranked(group)[0] == threads:  # it wins now: time the other soon
                group.interval = _FIRST_PROBE
            else:
                group.interval = min(2 * group.interval, _LAST_PROBE)
            group.next_probe = group.steps + group.interval

    def _group(self, num_tokens: int) -> _Group:
        key = min(num_tokens.bit_length(), _LARGEST_GROUP)
        if key not in self.groups:
            seconds = {t: deque(maxlen=_SAMPLES) for t in self.candidates}
            self.groups[key] = _Group(seconds)
        return self.groups[key]

    def _ranked(self, group: _Group) -> tuple[int, int]:
        """(the faster candidate, the other) by their median seconds per token."""
        a, b = self.candidates
        if statistics.median(group.seconds[b]) < statistics.median(group.seconds[a]):
            return b, a
        return a, b
