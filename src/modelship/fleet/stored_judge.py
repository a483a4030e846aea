"""The canary judge of a fleet of gateways: run by the elected leader alone, over the
evidence every gateway wrote to the shared storage, its decision written to the plan.

Each tick (`tick`, each second on the leader): read the plan; while a canary runs, read
the evidence lines added since the last tick (`canary_evidence.py`), feed those of the
current run to a `CanaryJudge` on wall-clock time, and ask its verdict. A rollback is
written to the plan (`end_canary`, an `auto_rollback` event with the reason and both
tracks' numbers); every gateway, this one included, follows it from there
(`plan_follower.py`). Nothing the judgement needs lives only in this process: a new leader
starts a fresh `StoredJudge`, which reads the files from the start of the judge's window
and reaches the verdict the dead leader would have.

A canary run is one `canary` event of the plan (`canary_run`): changing the weight starts
a new run, judged on its own traffic, as a single gateway's `CanarySplit.set_weight` does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from modelship.fleet.canary_evidence import EvidenceReader, evidence_dir
from modelship.gateway.canary import CanaryJudge, Verdict
from modelship.gateway.config import CanaryJudgeConfig
from modelship.release.traffic import TrafficPlan, end_canary, read_traffic
from modelship.storage import Storage

logger = logging.getLogger(__name__)

# Evidence written this much before the window (another machine's clock, a slow write) is
# still read; the judge's window drops what is too old.
_READ_SLACK_S = 60.0


def canary_run(plan: TrafficPlan, production: int | None) -> str | None:
    """The id of the canary run `plan` describes (`<release>:<weight>:<when it started>`),
    None when no canary runs (none, or it is production already)."""
    canary = plan.canary
    if canary is None or canary.release == production:
        return None
    started = next(
        (e.get("at", "") for e in reversed(plan.events)
         if e.get("action") == "canary" and e.get("release") == canary.release),
        "",
    )  # fmt: skip
    return f"{canary.release}:{canary.weight}:{started}"


class StoredJudge:
    """Judges the plan's current canary run from the evidence on storage."""

    def __init__(
        self,
        storage: Storage,
        slug: str,
        config: CanaryJudgeConfig,
        num_tenants: int = 1,
        on_rollback: Callable[[int, Verdict], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`on_rollback(release, verdict)`: after a rollback was written to the plan."""
        self.storage = storage
        self.slug = slug
        self.config = config
        self.num_tenants = num_tenants
        self.on_rollback = on_rollback
        self.clock = clock
        self.run: str | None = None
        self.judge: CanaryJudge | None = None
        self._reader: EvidenceReader | None = None

    def reset(self) -> None:
        """Forget what was read: the next tick reads the evidence on storage again (a
        gateway that lost the lease and later wins it back judges what it missed)."""
        self.run = self.judge = self._reader = None

    def tick(self) -> Verdict | None:
        """Read the plan and the new evidence, judge; the verdict (None: no canary runs).
        Raises what reading the plan raises (the caller logs it and tries again)."""
        plan = read_traffic(self.storage, self.slug)
        run = canary_run(plan, self.storage.production_release(self.slug))
        if run is None:
            self.reset()
            return None
        if run != self.run or self.judge is None or self._reader is None:
            self.run = run
            self.judge = CanaryJudge(self.config, self.clock, self.num_tenants)
            since = self.clock() - self.config.window_s - _READ_SLACK_S
            self._reader = EvidenceReader(evidence_dir(self.storage, self.slug), since)
        for evidence in self._reader.read_new():
            if evidence.run == run:
                self.judge.record(evidence.track, evidence.ok, evidence.ttft_s,
                                  evidence.tenant, at=evidence.at)  # fmt: skip
        verdict = self.judge.verdict()
        if verdict.rollback and self.config.auto_rollback:
            self._roll_back(verdict)
        return verdict

    def _roll_back(self, verdict: Verdict) -> None:
        reason = (
            f"{verdict.reason} (stable: {verdict.stable.describe()}; canary: "
            f"{verdict.canary.describe()})"
        )
        logger.warning("canary auto rollback: %s", reason)
        release = end_canary(self.storage, self.slug, reason, automatic=True)
        self.reset()
        if release is not None and self.on_rollback is not None:
            self.on_rollback(release, verdict)
