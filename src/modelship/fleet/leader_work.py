"""The fleet's run-once work, done by whichever gateway holds the leader lease
(`election.py`): the canary judge over the evidence on storage (`stored_judge.py`) and the
drift probe (`gateway/drift.py`).

Each `tick_s` the loop asks the election: leading, it runs one judge tick and keeps the
probe's loop running; not leading (never, or no longer), it stops the probe and forgets
the judge's reading, so that winning the lease later starts again from storage. A leader
that dies hands over nothing: its successor reads the evidence every gateway wrote, and
probes every replica at once (the probe's results are recomputed, not stored).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from modelship.fleet.election import LeaderElection
from modelship.fleet.stored_judge import StoredJudge
from modelship.gateway.drift import DriftProbe

logger = logging.getLogger(__name__)


class LeaderWork:
    def __init__(
        self,
        election: LeaderElection,
        judge: StoredJudge,
        probe: DriftProbe | None,
        tick_s: float = 1.0,
    ) -> None:
        """`probe`: None when `gateway.drift_probe.enabled` is off."""
        self.election = election
        self.judge = judge
        self.probe = probe
        self.tick_s = tick_s
        self._task: asyncio.Task | None = None
        self._probe_task: asyncio.Task | None = None

    async def tick(self) -> None:
        if not self.election.is_leader:
            await self._stop_probe()
            self.judge.reset()
            return
        if self.probe is not None and self._probe_task is None:
            self._probe_task = asyncio.create_task(self.probe.run())
        try:
            await asyncio.to_thread(self.judge.tick)  # file reads: off the event loop
        except Exception:  # a half-written plan or an unreachable storage: next tick
            logger.exception("the canary judge's tick failed; trying again")

    async def run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.tick_s)

    async def _stop_probe(self) -> None:
        task, self._probe_task = self._probe_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._stop_probe()
