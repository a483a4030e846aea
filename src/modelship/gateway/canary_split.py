"""The canary split one gateway process runs: its weight, its secret, its judge's window
and the rollback.

`canary.py` holds the pure parts (the keyed hash split, the judge's comparison); this
holds their state. A request's key stays on one side of the split, hashed with the
gateway's secret so a client choosing its session id cannot aim at (or away from) the
canary. The judge hears each replica result (`record`); a verdict against the canary sets
the weight to 0 at once and calls `on_rollback` once. Where several gateways share a
release plan (`fleet/standalone.py`), each hands its results to `evidence` instead, and
only the elected leader judges them all, from storage (`fleet/stored_judge.py`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable

from modelship.gateway.canary import CanaryJudge, Track, Verdict, in_canary
from modelship.gateway.config import CanaryJudgeConfig
from modelship.gateway.groups import CANARY
from modelship.gateway.metrics import GatewayMetrics
from modelship.gateway.pool import EndpointPool
from modelship.gateway.resilience import BreakerState

logger = logging.getLogger(__name__)


class CanarySplit:
    """Which track a request goes to, and whether the canary keeps its share."""

    def __init__(
        self,
        config: CanaryJudgeConfig,
        pool: EndpointPool,
        metrics: GatewayMetrics,
        weight: int,
        num_tenants: int,
    ) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.weight = weight  # percent of traffic to the canary
        # Several tenants: no one tenant's requests alone may roll a canary back.
        self.judge = CanaryJudge(config, num_tenants=num_tenants)
        secret = config.split_secret
        self.secret = hashlib.sha256(secret.encode()).digest() if secret else os.urandom(32)
        # Called once when the judge rolls the canary back (the fleet ends it on storage).
        self.on_rollback: Callable[[Verdict], None] | None = None
        # Set: each result goes there, and this process does not judge (another does).
        self.evidence: Callable[[Track, bool, float | None, str], None] | None = None

    def pick_track(self, tenant: str, key: str) -> Track:
        """The track for `key` (the tenant's session, user or conversation, else the
        request id). A request the split gives a canary whose every replica has its
        breaker open goes to stable, and counts as a canary failure for the judge: the
        canary failed enough requests in a row to be shut out, and without these the
        judge, starved of canary results, would never reach its `min_requests` and never
        roll it back."""
        if self.weight <= 0 or not in_canary(f"{tenant}\n{key}", self.weight, self.secret):
            return Track.STABLE
        if self.pool.has_routable(CANARY):
            return Track.CANARY
        canary = [u for u in self.pool if u.group == CANARY]
        if canary and all(u.breaker.state is BreakerState.OPEN for u in canary):
            self.record(Track.CANARY, ok=False, ttft_s=None, tenant=tenant)
        return Track.STABLE

    def share_secret(self, secret: str) -> None:
        """Split with `secret`, the one every gateway replica uses (`shared_decisions.py`),
        instead of this process's own."""
        self.secret = hashlib.sha256(secret.encode()).digest()

    def record(self, track: Track, ok: bool, ttft_s: float | None, tenant: str) -> None:
        """One request's result on `track`; a canary's may roll the canary back (here, or
        where `evidence` takes it)."""
        if self.evidence is not None:
            self.evidence(track, ok, ttft_s, tenant)
            return
        self.judge.record(track, ok, ttft_s, tenant)
        if track is Track.CANARY:
            self._judge()

    def set_weight(self, weight: int) -> None:
        if weight != self.weight:
            self.judge.reset()  # each canary is judged on its own traffic
            self.weight = weight

    def _judge(self) -> None:
        # At 100 (a standalone gateway after a promotion) the canary track serves
        # production and stable gets only fallbacks: nothing to compare it with.
        if not self.config.auto_rollback or not 0 < self.weight < 100:
            return
        verdict = self.judge.verdict()
        if not verdict.rollback:
            return
        self.weight = 0  # from this request on, nothing goes to the canary
        logger.warning("canary rolled back: %s", verdict.reason)
        canary_release = next((u.release for u in self.pool if u.group == CANARY), "none")
        self.metrics.canary_rollbacks.labels(canary_release).inc()
        if self.on_rollback is not None:
            self.on_rollback(verdict)
