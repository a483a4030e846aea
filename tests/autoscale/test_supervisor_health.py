"""The supervisor replaces replicas that live on without serving, and gives up a canary
whose replicas keep failing; real child processes (tiny HTTP servers on the socket the
supervisor hands them), an injected clock.

Found by the fleet and rollout drills: a replica whose engine died answered /health 503
forever and was never replaced (the supervisor only noticed exited processes), and a
canary whose weights made every replica fail its warm-up restarted forever, never judged
(no request ever reached it) and never rolled back. And the warm pool: ready replicas
kept out of routing until a scale-out takes one."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from modelship.fleet.metrics import FleetMetrics
from modelship.fleet.supervisor import AutoscaleConfig, ReleaseSpec, ReplicaState, Supervisor
from modelship.gateway.config import GatewayConfig
from modelship.gateway.groups import CANARY, STABLE, Group, tier_group
from modelship.gateway.pool import EndpointPool
from modelship.gateway.service import GatewayService
from modelship.gateway.tiers import TierConfig
from modelship.server.process import ReplicaProcess

# /ready answers 200; /health answers the status given (503: "my engine is dead").
FAKE_REPLICA = """
import socket, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
fd, health = int(sys.argv[1]), int(sys.argv[2])
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args): pass
    def do_GET(self):
        self.send_response(health if self.path == "/health" else 200)
        self.send_header("content-length", "0")
        self.end_headers()
server = HTTPServer(("127.0.0.1", 0), Handler, bind_and_activate=False)
server.socket.close()
server.socket = socket.socket(fileno=fd)
server.socket.listen()
server.serve_forever()
"""
# What a replica whose warm-up fails does: a last log line, then exit 3.
FAILING_REPLICA = "print('NonFiniteLogitsError: NaN logits'); raise SystemExit(3)"


class FakeReplica(ReplicaProcess):
    def __init__(self, model_dir: Path, log_path: Path, health: int | None) -> None:
        self.health = health  # None: fail at start
        super().__init__(model_dir, log_path=log_path)

    def command(self) -> list[str]:
        assert self._socket is not None
        if self.health is None:
            return [sys.executable, "-c", FAILING_REPLICA]
        return [sys.executable, "-c", FAKE_REPLICA, str(self._socket.fileno()), str(self.health)]


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def launched() -> list[ReplicaProcess]:
    processes: list[ReplicaProcess] = []
    yield processes
    for process in processes:
        process.process.send_signal(signal.SIGCONT)
        process.kill()
        process.process.wait()


def make_supervisor(tmp_path: Path, launched: list, clock: FakeClock, health: int | None, **config):
    def launch(spec: ReleaseSpec, replica_id: str) -> ReplicaProcess:
        log = tmp_path / f"{replica_id}.log"
        launched.append(FakeReplica(spec.model_dir, log, health))
        return launched[-1]

    settings = {"min_replicas": 1, "max_replicas": 1, "restart_backoff_s": 1.0, **config}
    pool = EndpointPool(GatewayConfig().resilience)
    # A cheaper tier with the stable track's bounds: every group is scaled the same way.
    economy = TierConfig(name="economy", variant="int4", min_replicas=settings["min_replicas"],
                         max_replicas=settings["max_replicas"])  # fmt: skip
    return Supervisor(AutoscaleConfig(**settings), pool, None, launch, clock, tiers=[economy])


async def wait_ready(supervisor: Supervisor, clock: FakeClock) -> None:
    for _ in range(100):
        await supervisor.tick()
        if supervisor.count(STABLE, ReplicaState.READY):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the fake replica never became ready")


def test_a_ready_replica_whose_health_says_503_is_replaced(
    tmp_path: Path, launched: list, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(1000.0)
    supervisor = make_supervisor(tmp_path, launched, clock, health=503)
    supervisor.set_target(STABLE, ReleaseSpec(1, tmp_path, "fp16"))

    async def ticks() -> None:
        async with httpx.AsyncClient(timeout=1.0) as client:
            supervisor._client = client
            await wait_ready(supervisor, clock)
            assert supervisor.pool.get("replica-1") is not None
            with caplog.at_level(logging.ERROR, logger="modelship.fleet.supervisor"):
                await supervisor.tick()

    asyncio.run(ticks())
    assert launched[0].process.poll() == -signal.SIGKILL
    assert supervisor.replicas == [] and supervisor.pool.get("replica-1") is None
    assert "replica-1 is ready but /health answered 503: replacing it" in caplog.text
    assert supervisor.groups[STABLE].next_start_at == 1001.0  # a restart, as a crash


def test_a_silent_replica_is_replaced_only_after_max_unresponsive_s(
    tmp_path: Path, launched: list
) -> None:
    clock = FakeClock(1000.0)
    supervisor = make_supervisor(tmp_path, launched, clock, health=200, max_unresponsive_s=30)
    supervisor.set_target(STABLE, ReleaseSpec(1, tmp_path, "fp16"))
    service = GatewayService(GatewayConfig(), supervisor.pool)

    async def ticks() -> None:
        async with httpx.AsyncClient(timeout=1.0) as client:
            supervisor._client = client
            await wait_ready(supervisor, clock)
            launched[0].process.send_signal(signal.SIGSTOP)  # hung: alive, silent
            await supervisor.tick()  # 0 s of silence
            clock.now += 20
            await supervisor.tick()  # 20 s: maybe a long pause, it may come back
            assert [r.replica_id for r in supervisor.replicas] == ["replica-1"]
            # The gateway's health checks have marked it; the gauges say so.
            supervisor.pool.get("replica-1").is_healthy = False
            assert ("stable", "1", "fp16", "unhealthy") in supervisor.snapshot(service).replicas
            clock.now += 11
            await supervisor.tick()  # 31 s

    asyncio.run(ticks())
    assert supervisor.replicas == []
    assert launched[0].process.poll() == -signal.SIGKILL


def test_a_canary_whose_replicas_keep_failing_is_given_up_once(
    tmp_path: Path, launched: list
) -> None:
    clock = FakeClock(1000.0)
    supervisor = make_supervisor(
        tmp_path, launched, clock, health=None, max_canary_failures=3, max_restart_backoff_s=4
    )
    reasons: list[str] = []

    def give_up(reason: str) -> None:  # what the fleet does: end the canary
        reasons.append(reason)
        supervisor.set_target(CANARY, None)

    supervisor.on_canary_failed = give_up
    supervisor.set_target(CANARY, ReleaseSpec(2, tmp_path, "nan"))

    async def ticks() -> None:
        async with httpx.AsyncClient(timeout=1.0) as client:
            supervisor._client = client
            for _ in range(6):
                await supervisor.tick()  # starts one, or notices it died
                for process in launched:
                    process.process.wait(timeout=30)
                clock.now += 10  # past any backoff

    asyncio.run(ticks())
    assert len(launched) == 3 and len(reasons) == 1
    assert reasons[0].startswith("the canary's replicas failed 3 times (last: exited with 3")
    assert "NonFiniteLogitsError" in reasons[0]
    assert supervisor.groups[CANARY].target is None and supervisor.replicas == []


# A cheaper tier's group has the stable track's warm pool and scale-out metric (before the
# groups were one, a tier was scaled by code of its own, with neither).
@pytest.mark.parametrize("group", [STABLE, tier_group("economy")], ids=str)
def test_a_scale_out_routes_a_warm_replica_at_once_and_refills_the_pool(
    tmp_path: Path, launched: list, group: Group
) -> None:
    clock = FakeClock(1000.0)
    supervisor = make_supervisor(
        tmp_path, launched, clock, health=200, max_replicas=2, warm_pool=1,
        target_concurrency=1, scale_up_window_s=0, scale_down_window_s=0,
    )  # fmt: skip
    registry = CollectorRegistry()
    supervisor.metrics = FleetMetrics(registry)
    supervisor.set_target(group, ReleaseSpec(1, tmp_path, "fp16"))
    service = GatewayService(GatewayConfig(), supervisor.pool)

    def states() -> dict[str, int]:
        return {s: supervisor.count(group, s) for s in ReplicaState if s != "draining"}

    async def ticks() -> None:
        async with httpx.AsyncClient(timeout=1.0) as client:
            supervisor._client = client
            for _ in range(100):  # one replica routed, one ready in the warm pool
                await supervisor.tick()
                if states() == {"starting": 0, "ready": 1, "standby": 1}:
                    break
                await asyncio.sleep(0.1)
            assert states() == {"starting": 0, "ready": 1, "standby": 1}
            assert len(list(supervisor.pool)) == 1  # the warm one takes no traffic
            assert (group.label, "1", "fp16", "standby") in supervisor.snapshot(service).replicas

            routed = next(iter(supervisor.pool)).endpoint
            routed.add_request(1)
            routed.add_request(1)  # load for two replicas
            clock.now += 1
            await supervisor.tick()
            # In this very tick: the warm replica routed, a new one starting to refill
            assert states() == {"starting": 1, "ready": 2, "standby": 0}
            assert len(list(supervisor.pool)) == 2

            routed.remove_request(1)
            routed.remove_request(1)
            clock.now += 1
            await supervisor.tick()  # load gone: an idle routed replica is parked, not stopped
            assert states()["ready"] == 1 and len(list(supervisor.pool)) == 1
            assert states()["standby"] + states()["starting"] == 1

    asyncio.run(ticks())

    def scale_out(stat: str, source: str) -> float | None:
        name = f"modelship_gateway_scale_out_seconds_{stat}"
        return registry.get_sample_value(name, {"source": source})

    # the warm replica took traffic in the very tick that wanted it (the clock stood still)
    assert (scale_out("count", "warm"), scale_out("sum", "warm")) == (1.0, 0.0)
    scaled_up = {"track": group.label, "direction": "up"}
    assert registry.get_sample_value("modelship_gateway_scale_events_total", scaled_up) == 1.0
    assert len(launched) == 3
