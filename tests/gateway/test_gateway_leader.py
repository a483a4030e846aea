"""Two real standalone gateways on one storage elect one leader with the lease file
(`fleet/election.py`); the leader is killed (SIGKILL: no clean give-up) and the other
takes the lease over once it expires. The run-once work behind the lease (the canary
judge, the drift probe) is not moved there yet: this covers the election and handover."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gateway_process import GatewayProcess
from modelship.fleet.election import lease_path
from modelship.storage import Storage
from vllm_stand_in import VllmStandIn

from fleet_storage import publish_release

SLUG = "tiny"
LEASE_S = 2
pytestmark = pytest.mark.timeout(180)


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def leads(gateway: GatewayProcess) -> bool:
    return gateway.metric("modelship_gateway_leader") == 1


def test_one_leader_and_the_other_takes_over_when_it_dies(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "storage")
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    publish_release(storage, SLUG, weights, "fp16")
    storage.set_production(SLUG, 1)
    replica = VllmStandIn()
    gateways: list[GatewayProcess] = []
    try:
        for name in ("a", "b"):
            folder = tmp_path / name
            folder.mkdir()
            gateways.append(GatewayProcess(
                folder, {}, "--engine", "vllm", "--endpoint", replica.url, "--storage",
                str(storage.root), "--model", SLUG, "--leader-lease-s", str(LEASE_S),
            ))  # fmt: skip
        for gateway in gateways:
            gateway.wait_ready(60)
        wait_for(lambda: any(leads(g) for g in gateways), 20, "a leader")
        time.sleep(LEASE_S)  # several renewals: the follower keeps waiting
        leader, follower = sorted(gateways, key=leads, reverse=True)
        assert leads(leader) and not leads(follower)
        lease = json.loads(lease_path(storage, SLUG).read_text())
        assert lease["holder"].endswith(f"-{leader.pid}") and lease["transitions"] == 0

        leader.kill()
        wait_for(lambda: leads(follower), 10 * LEASE_S, "the follower to take the lease")
        lease = json.loads(lease_path(storage, SLUG).read_text())
        assert lease["holder"].endswith(f"-{follower.pid}") and lease["transitions"] == 1

        assert follower.stop() == 0, follower.log_tail()  # a clean stop gives the lease up
        assert json.loads(lease_path(storage, SLUG).read_text())["expires_at"] <= time.time()
    finally:
        for gateway in gateways:
            gateway.stop()
        replica.stop()
