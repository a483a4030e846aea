"""The supervisor's bookkeeping with an injected clock and real (idle) child processes."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import httpx
import pytest

from modelship.fleet.supervisor import AutoscaleConfig, ReleaseSpec, ReplicaState, Supervisor
from modelship.gateway.config import ResilienceConfig
from modelship.gateway.groups import STABLE, Group, tier_group
from modelship.gateway.pool import EndpointPool
from modelship.gateway.tiers import TierConfig
from modelship.server.process import ReplicaProcess


class NeverReady(ReplicaProcess):
    """Holds its port but never listens: /ready is refused until the supervisor gives up."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(120)"]


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_replica_not_ready_in_time_is_killed_and_the_log_says_how_long(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(1000.0)  # far from time.monotonic(): a mixed-up clock shows at once
    launched: list[ReplicaProcess] = []

    def launch(spec: ReleaseSpec, replica_id: str) -> ReplicaProcess:
        launched.append(NeverReady(spec.model_dir, log_path=tmp_path / f"{replica_id}.log"))
        return launched[-1]

    config = AutoscaleConfig(
        min_replicas=1, max_replicas=1, replica_start_timeout_s=300, restart_backoff_s=10
    )
    supervisor = Supervisor(config, EndpointPool(ResilienceConfig()), None, launch, clock)
    supervisor.set_target(STABLE, ReleaseSpec(1, tmp_path, "fp16"))

    async def ticks() -> None:
        async with httpx.AsyncClient(timeout=1.0) as client:
            supervisor._client = client  # what run() sets up
            await supervisor.tick()
            assert [r.replica_id for r in supervisor.replicas] == ["replica-1"]
            clock.now = 1200.0
            await supervisor.tick()  # 200 s: still waiting
            assert not launched[0].has_exited()
            clock.now = 1400.0
            with caplog.at_level(logging.ERROR, logger="modelship.fleet.supervisor"):
                await supervisor.tick()

    try:
        asyncio.run(ticks())
        assert launched[0].process.wait(timeout=10) != 0  # killed
        assert supervisor.replicas == []
        assert "replica-1 not ready after 400s" in caplog.text
        assert supervisor.groups[STABLE].next_start_at == 1410.0  # backoff, same clock
    finally:
        for process in launched:
            process.kill()
            process.process.wait()


# Before the groups were one, a cheaper tier's stale replica still starting went on
# starting beside its replacement until one of the new release was ready.
@pytest.mark.parametrize("group", [STABLE, tier_group("economy")], ids=str)
def test_a_stale_replica_still_starting_is_drained_at_once(tmp_path: Path, group: Group) -> None:
    clock = FakeClock(1000.0)
    launched: list[ReplicaProcess] = []

    def launch(spec: ReleaseSpec, replica_id: str) -> ReplicaProcess:
        launched.append(NeverReady(spec.model_dir, log_path=tmp_path / f"{replica_id}.log"))
        return launched[-1]

    config = AutoscaleConfig(min_replicas=1, max_replicas=1)
    economy = TierConfig(name="economy", variant="int4")
    pool = EndpointPool(ResilienceConfig())
    supervisor = Supervisor(config, pool, None, launch, clock, tiers=[economy])
    supervisor.set_target(group, ReleaseSpec(1, tmp_path, "fp16"))

    async def ticks() -> None:
        async with httpx.AsyncClient(timeout=1.0) as client:
            supervisor._client = client
            await supervisor.tick()
            supervisor.set_target(group, ReleaseSpec(2, tmp_path, "int4"))
            clock.now += 1
            await supervisor.tick()

    try:
        asyncio.run(ticks())
        replicas = [(r.replica_id, r.state, r.spec.release) for r in supervisor.replicas]
        assert replicas == [
            ("replica-1", ReplicaState.DRAINING, 1),
            ("replica-2", ReplicaState.STARTING, 2),
        ]
        assert launched[0].process.wait(timeout=10) != 0  # SIGTERM: nothing was in flight
    finally:
        for process in launched:
            process.kill()
            process.process.wait()
