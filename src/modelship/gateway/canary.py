"""Canary releases: the sticky traffic split, and the judge that rolls a bad canary back.

Pure apart from the injected clock. The gateway records one `Outcome` per finished
request on the track it was routed to ("stable" or "canary"), with the tenant that sent
it, and asks `verdict()` after each canary result.

What is judged has to be the release's doing, not a client's. Latency is the first-token
time of streams only, scaled to a prompt of `REFERENCE_PROMPT_TOKENS` when longer
(`judged_ttft`): a non-streaming answer arrives whole, and its time is mostly the output
length the client asked for (one `max_tokens: 60, ignore_eos` request on the canary read
as a 2.9 s "TTFT" against stable's 0.1 s). And on a gateway with several tenants, a
rollback must still be called for without any one tenant's requests: else one tenant that
found a canary session could roll back a healthy canary on its own.
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


# Prefill time grows with the prompt: a longer prompt's first-token time is scaled down to
# this many tokens' worth, so long prompts (anyone's to send) do not read as a slow release.
REFERENCE_PROMPT_TOKENS = 512


def judged_ttft(first_token_s: float, prompt_tokens: int) -> float:
    """A stream's first-token time as the judge compares it (see the module doc)."""
    return first_token_s * REFERENCE_PROMPT_TOKENS / max(prompt_tokens, REFERENCE_PROMPT_TOKENS)


@dataclass(frozen=True)
class Outcome:
    at: float
    ok: bool  # False: a 5xx from the replica, a broken connection, a timeout
    ttft_s: float | None  # `judged_ttft` of a stream; None otherwise, or when it failed
    tenant: str = ""


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


def _stats(outcomes: list[Outcome]) -> TrackStats:
    num_failed = sum(not outcome.ok for outcome in outcomes)
    ttfts = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    rate = num_failed / len(outcomes) if outcomes else 0.0
    return TrackStats(len(outcomes), rate, p95(ttfts))


class CanaryJudge:
    """Compares the canary with stable over the last `window_s` seconds.

    Rollback when both tracks have `min_requests` in the window and the canary's error
    rate exceeds stable's by more than `max_error_rate_margin`, or its TTFT p95 exceeds
    `max_ttft_p95_ratio` x stable's and by at least `min_ttft_increase_s`. With
    `num_tenants` > 1 (the gateway's configured tenants), the same must hold with each
    tenant's requests left out of both tracks in turn, so a canary only one tenant has
    reached (or only one finds slow) is never rolled back on that tenant's word.
    """

    def __init__(
        self,
        config: CanaryJudgeConfig,
        clock: Callable[[], float] = time.monotonic,
        num_tenants: int = 1,
    ) -> None:
        self.config = config
        self.clock = clock
        self.num_tenants = num_tenants
        self._outcomes: dict[Track, deque[Outcome]] = {track: deque() for track in Track}

    def reset(self) -> None:
        for outcomes in self._outcomes.values():
            outcomes.clear()

    def record(
        self,
        track: Track,
        ok: bool,
        ttft_s: float | None,
        tenant: str = "",
        at: float | None = None,
    ) -> None:
        """`ttft_s`: a stream's `judged_ttft`, else None (judged on errors alone); `at`:
        when it finished, on `clock`'s scale (None: now). Outcomes may come out of order
        (several gateways' evidence read from storage)."""
        self._outcomes[track].append(Outcome(self.clock() if at is None else at, ok, ttft_s,
                                             tenant))  # fmt: skip

    def _window(self, track: Track) -> list[Outcome]:
        outcomes = self._outcomes[track]
        oldest = self.clock() - self.config.window_s
        while outcomes and outcomes[0].at < oldest:
            outcomes.popleft()
        return [outcome for outcome in outcomes if outcome.at >= oldest]

    def stats(self, track: Track) -> TrackStats:
        return _stats(self._window(track))

    def verdict(self) -> Verdict:
        stable, canary = self._window(Track.STABLE), self._window(Track.CANARY)
        verdict = self._compare(_stats(stable), _stats(canary))
        if not verdict.rollback or self.num_tenants < 2:
            return verdict
        for tenant in sorted({outcome.tenant for outcome in canary}):
            without = self._compare(
                _stats([o for o in stable if o.tenant != tenant]),
                _stats([o for o in canary if o.tenant != tenant]),
            )
            if not without.rollback:
                reason = (
                    f"{verdict.reason}, but not without one tenant's requests ({without.reason})"
                )
                return Verdict(False, reason, verdict.stable, verdict.canary)
        return verdict

    def _compare(self, stable: TrackStats, canary: TrackStats) -> Verdict:
        config = self.config
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
