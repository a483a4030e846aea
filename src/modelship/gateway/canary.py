"""Canary releases: the sticky traffic split, and the judge that rolls a bad canary back.

Pure apart from the injected clock. The gateway records one `Outcome` per finished
request on the track it was routed to ("stable" or "canary") and asks `verdict()` after
each canary result.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from modelship.gateway.config import CanaryJudgeConfig


class Track(StrEnum):
    STABLE = "stable"
    CANARY = "canary"


def in_canary(key: str, weight: int, secret: bytes = b"") -> bool:
    """Whether `key` falls in the canary's `weight` percent. Sticky: the same key always
    lands on the same side, and raising the weight only moves keys from stable to canary.
    With a `secret` (at most 64 bytes) the side cannot be computed without it."""
    if weight <= 0:
        return False
    digest = hashlib.blake2b(key.encode(), digest_size=8, key=secret).digest()
    return int.from_bytes(digest, "big") % 10_000 < weight * 100


@dataclass(frozen=True)
class Outcome:
    at: float
    ok: bool  # False: a 5xx from the replica, a broken connection, a timeout
    ttft_s: float | None  # first byte seen by the gateway; None when it failed first


@dataclass(frozen=True)
class TrackStats:
    num_requests: int
    error_rate: float
    ttft_p95_s: float | None

    def describe(self) -> str:
        ttft = "n/a" if self.ttft_p95_s is None else f"{self.ttft_p95_s * 1000:.0f} ms"
        return f"{self.num_requests} requests, {self.error_rate:.1%} errors, TTFT p95 {ttft}"


@dataclass(frozen=True)
class Verdict:
    rollback: bool
    reason: str
    stable: TrackStats
    canary: TrackStats


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


class CanaryJudge:
    """Compares the canary with stable over the last `window_s` seconds.

    Rollback when both tracks have `min_requests` in the window and the canary's error
    rate exceeds stable's by more than `max_error_rate_margin`, or its TTFT p95 exceeds
    `max_ttft_p95_ratio` x stable's and by at least `min_ttft_increase_s`.
    """

    def __init__(self, config: CanaryJudgeConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._outcomes: dict[Track, deque[Outcome]] = {track: deque() for track in Track}

    def reset(self) -> None:
        for outcomes in self._outcomes.values():
            outcomes.clear()

    def record(self, track: Track, ok: bool, ttft_s: float | None) -> None:
        self._outcomes[track].append(Outcome(self.clock(), ok, ttft_s))

    def stats(self, track: Track) -> TrackStats:
        outcomes = self._outcomes[track]
        oldest = self.clock() - self.config.window_s
        while outcomes and outcomes[0].at < oldest:
            outcomes.popleft()
        num_failed = sum(not outcome.ok for outcome in outcomes)
        ttfts = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
        rate = num_failed / len(outcomes) if outcomes else 0.0
        return TrackStats(len(outcomes), rate, p95(ttfts))

    def verdict(self) -> Verdict:
        config = self.config
        stable, canary = self.stats(Track.STABLE), self.stats(Track.CANARY)
        if min(stable.num_requests, canary.num_requests) < config.min_requests:
            return Verdict(False, "not enough requests yet", stable, canary)
        if canary.error_rate > stable.error_rate + config.max_error_rate_margin:
            reason = (
                f"canary error rate {canary.error_rate:.1%} exceeds stable's "
                f"{stable.error_rate:.1%} by more than {config.max_error_rate_margin:.1%}"
            )
            return Verdict(True, reason, stable, canary)
        if (
            canary.ttft_p95_s is not None
            and stable.ttft_p95_s is not None
            and canary.ttft_p95_s > stable.ttft_p95_s * config.max_ttft_p95_ratio
            and canary.ttft_p95_s - stable.ttft_p95_s >= config.min_ttft_increase_s
        ):
            reason = (
                f"canary TTFT p95 {canary.ttft_p95_s * 1000:.0f} ms exceeds "
                f"{config.max_ttft_p95_ratio:g} x stable's {stable.ttft_p95_s * 1000:.0f} ms"
            )
            return Verdict(True, reason, stable, canary)
        return Verdict(False, "within margins", stable, canary)
