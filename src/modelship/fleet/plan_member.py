"""A standalone gateway's part in a fleet of gateways that share one release plan on storage
(`modelship gateway --storage S --model M`, as every replica of the rendered gateway runs).

Every member: follows the plan (`plan_follower.py`: the canary weight, rollback and
promotion, read each second); writes what it saw of the canary and of stable while a
canary runs to an evidence file of its own (`canary_evidence.py`), instead of judging it;
stands for the leader lease (`election.py`). The member holding the lease also runs the
fleet's run-once work (`leader_work.py`): the canary judge over every member's evidence,
and the drift probe. Their decisions go to the plan on storage, which every member
follows: one writer of decisions, however many gateways route.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from modelship.errors import PipelineError
from modelship.fleet.canary_evidence import CanaryEvidence, EvidenceLog, evidence_dir
from modelship.fleet.election import LeaderElection, StorageLease, lease_path
from modelship.fleet.golden_source import GoldenSource
from modelship.fleet.leader_work import LeaderWork
from modelship.fleet.plan_follower import PROMOTED_WEIGHT, PlanFollower, standalone_canary_weight
from modelship.fleet.stored_judge import StoredJudge, canary_run
from modelship.gateway.canary import Track, Verdict
from modelship.gateway.cost import writer_name
from modelship.gateway.drift import DriftProbe, ProbeResult
from modelship.gateway.groups import CANARY
from modelship.gateway.pool import Upstream
from modelship.gateway.service import GatewayService
from modelship.release import golden
from modelship.release.traffic import TrafficPlan, end_canary
from modelship.storage import Storage, StorageError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanSource:
    """Where a standalone gateway reads the release plan: the shared storage, one model."""

    storage: Storage
    slug: str


class PlanMember:
    """Wires `service` into the fleet sharing `source`'s plan; `start`/`stop` with the app.

    `lease_s`: how long the leader lease lasts unrenewed (a dead leader's successor takes
    over that long after its last renewal)."""

    def __init__(self, source: PlanSource, service: GatewayService, lease_s: float) -> None:
        self.storage = source.storage
        self.slug = source.slug
        self.service = service
        config = service.config
        self.follower = PlanFollower(self.storage, self.slug, self._follow)
        self._plan = TrafficPlan()
        self._production: int | None = None
        self._run: str | None = None  # the canary run the evidence written now belongs to
        self.evidence = EvidenceLog(evidence_dir(self.storage, self.slug), writer_name())
        service.canary.evidence = self._record
        lease = StorageLease(self.storage, lease_path(self.storage, self.slug), writer_name(),
                             duration_s=lease_s)  # fmt: skip
        self.election = LeaderElection(lease)
        service.metrics.fleet_registry.register(self.election)
        self.golden = GoldenSource(self.storage, self.slug)
        probe = None
        if config.drift_probe.enabled:
            probe = DriftProbe(config.drift_probe, service.pool, lambda: service.client,
                               self._reference, headers=service.upstream_headers,
                               on_drift=self._drifted)  # fmt: skip
            service.metrics.fleet_registry.register(probe)
        judge = StoredJudge(self.storage, self.slug, config.canary, len(config.tenants),
                            on_rollback=self._judged)  # fmt: skip
        self.leader_work = LeaderWork(self.election, judge, probe)

    def _follow(self, plan: TrafficPlan, production: int | None) -> None:
        self._plan, self._production = plan, production
        self._run = canary_run(plan, production)
        self.service.canary.set_weight(standalone_canary_weight(plan, production))

    def _record(self, track: Track, ok: bool, ttft_s: float | None, tenant: str) -> None:
        """A replica result (`CanarySplit.evidence`): kept while a canary run is followed."""
        if self._run is not None:
            self.evidence.append(CanaryEvidence(time.time(), self._run, track, ok, ttft_s,
                                                tenant))  # fmt: skip

    def _judged(self, release: int, verdict: Verdict) -> None:
        self.service.metrics.canary_rollbacks.labels(str(release)).inc()

    def _release_number(self, label: str) -> int | None:
        """The release a replica labelled `label` serves: a number (a discovered pod's
        label), or its track's release under the plan (None: the track serves none now)."""
        if label.isdigit():
            return int(label)
        if label != str(Track.CANARY):
            return self._production
        if self._plan.canary is not None:
            return self._plan.canary.release
        promoted = standalone_canary_weight(self._plan, self._production) == PROMOTED_WEIGHT
        return self._production if promoted else None  # rolled back: takes no traffic

    def _reference(self, label: str, variant: str) -> list[golden.GoldenAnswer] | None:
        number = self._release_number(label)
        return None if number is None else self.golden.reference(number, variant)

    def _drifted(self, upstream: Upstream, result: ProbeResult) -> None:
        """The leader's probe found a replica drifted: a canary's is rolled back on the plan
        (stable has nothing to fall back to: the alert metric is the signal)."""
        probe = self.service.config.drift_probe
        if upstream.group != CANARY or not probe.rollback_canary:
            return
        reason = (
            f"quality drift: {upstream.endpoint_id} reproduced {result.agreement.tokens:.0%} "
            f"of the golden answers (minimum {probe.min_agreement:.0%})"
        )
        try:
            release = end_canary(self.storage, self.slug, reason, automatic=True)
        except (OSError, PipelineError, StorageError) as exc:  # probed again next interval
            logger.error("the drifted canary could not be rolled back on the plan: %s", exc)
            return
        if release is not None:
            logger.warning("canary auto rollback: %s", reason)
            self.service.metrics.canary_rollbacks.labels(str(release)).inc()

    async def start(self) -> None:
        await self.follower.start()
        await self.election.start()
        await self.leader_work.start()

    async def stop(self) -> None:
        await self.leader_work.stop()
        await self.election.stop()  # gives the lease up: the next leader starts at once
        await self.follower.stop()
        self.evidence.close()
