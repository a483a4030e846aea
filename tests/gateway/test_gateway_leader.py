"""Two real standalone gateways on one storage elect one leader with the lease file
(`fleet/election.py`); the leader is killed (SIGKILL: no clean give-up) and the other
takes the lease over once it expires. The run-once work behind the lease runs in the
leader alone: the drift probe, and the canary judge over the evidence both gateways wrote
to storage, which the next leader reads to finish a judgement the dead one began."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from gateway_process import GatewayProcess
from modelship.fleet.canary_evidence import evidence_dir
from modelship.fleet.election import lease_path
from modelship.release import golden
from modelship.release.traffic import read_traffic, start_canary
from modelship.storage import Storage
from vllm_stand_in import VllmStandIn

from bad_replica import BadReplica
from fleet_storage import publish_release
from server_process import ServerProcess

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


MIN_REQUESTS = 8  # per track, before the judge judges
TINY_ARGS = ("--served-model-name", SLUG, "--max-model-len", "128", "--kv-cache-memory-mb", "8")


def record_golden(url: str, release_dir: Path) -> None:
    """The replica's greedy answer to one golden prompt, as select would record it."""

    async def ask() -> list[golden.GoldenAnswer]:
        async with httpx.AsyncClient() as client:
            return [await golden.ask(client, url, SLUG, golden.GOLDEN_PROMPTS[0])]

    golden.write_reference(release_dir / golden.GOLDEN_FILE, asyncio.run(ask()))


def evidence_lines(storage: Storage) -> Counter[tuple[str, str]]:
    """(writer's pid, track) -> lines of canary evidence on storage."""
    lines: Counter[tuple[str, str]] = Counter()
    for path in evidence_dir(storage, SLUG).glob("*.jsonl"):
        pid = path.name.split(".")[1].rsplit("-", 1)[1]
        for line in path.read_text().splitlines():
            lines[pid, json.loads(line)["track"]] += 1
    return lines


def total(lines: Counter[tuple[str, str]], track: str) -> int:
    return sum(count for (_, on), count in lines.items() if on == track)


def complete(gateway: GatewayProcess, session: int) -> int:
    body = {"model": SLUG, "prompt": "hi", "max_tokens": 2}
    answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60,
                        headers={"x-session-id": f"s{session}"})  # fmt: skip
    return answer.status_code


@pytest.mark.timeout(600)  # a real replica's start (torch) is slow on a loaded machine
def test_the_leader_alone_judges_and_probes_and_the_next_one_finishes(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Release 2, the canary, fails every completion (a misbehaving replica); stable is a
    real `modelship serve` of release 1. The leader sees part of the canary's failures,
    fewer than the judge needs, and is killed; the survivor takes the lease, sees the
    rest, and rolls the canary back on a verdict over both gateways' evidence."""
    storage = Storage(tmp_path / "storage")
    publish_release(storage, SLUG, tiny_llama_dir, "fp16")
    publish_release(storage, SLUG, tiny_llama_dir, "gptq")
    storage.set_production(SLUG, 1)
    stable = ServerProcess(storage.release_dir(SLUG, 1), *TINY_ARGS, timeout_s=300)
    canary = BadReplica("500")
    gateways: list[GatewayProcess] = []
    judge = {"canary": {"min_requests": MIN_REQUESTS, "window_s": 600}}
    try:
        record_golden(stable.url, storage.release_dir(SLUG, 1))
        for name in ("a", "b"):
            folder = tmp_path / name
            folder.mkdir()
            gateways.append(GatewayProcess(
                folder, judge, "--endpoint", stable.url, "--canary-endpoint", canary.url,
                "--storage", str(storage.root), "--model", SLUG,
                "--leader-lease-s", str(LEASE_S),
            ))  # fmt: skip
        for gateway in gateways:
            gateway.wait_ready(120)
        wait_for(lambda: any(leads(g) for g in gateways), 20, "a leader")
        leader, survivor = sorted(gateways, key=leads, reverse=True)

        # The drift probe runs in the leader only: stable reproduces its golden answer.
        probes = "modelship_gateway_drift_probes_total"
        wait_for(lambda: leader.metric(probes, outcome="ok") >= 1, 60, "the leader's probe")
        time.sleep(LEASE_S)  # several renewals
        assert leads(leader) and not leads(survivor)
        assert survivor.metric(probes) == 0
        assert leader.metric("modelship_gateway_drift_agreement", track="stable") == 1.0

        start_canary(storage, SLUG, 2, 50)
        weights = ("modelship_gateway_canary_weight",)
        wait_for(lambda: all(g.metric(*weights) == 50 for g in gateways), 20, "the canary")
        session = 0
        while total(evidence_lines(storage), "canary") < 3:
            complete(leader, session)
            session += 1
        assert read_traffic(storage, SLUG).canary is not None  # not enough to judge yet

        leader.kill()
        wait_for(lambda: leads(survivor), 10 * LEASE_S, "the survivor to take the lease")
        wait_for(lambda: survivor.metric(probes, outcome="ok") >= 1, 60, "the new probe")
        lines = evidence_lines(storage)
        while min(total(lines, "canary"), total(lines, "stable")) < MIN_REQUESTS:
            complete(survivor, session)
            session += 1
            lines = evidence_lines(storage)
        wait_for(lambda: read_traffic(storage, SLUG).canary is None, 30, "the rollback")

        event = read_traffic(storage, SLUG).events[-1]
        assert event["action"] == "auto_rollback" and event["release"] == 2, event
        judged = re.search(r"canary: (\d+) requests, 100.0% errors", event["reason"])
        assert judged is not None, event
        # Judged on both gateways' evidence: the survivor's alone was not enough.
        assert int(judged[1]) == total(lines, "canary") >= MIN_REQUESTS
        assert lines[str(leader.pid), "canary"] >= 3
        assert lines[str(survivor.pid), "canary"] < MIN_REQUESTS
        assert survivor.metric("modelship_gateway_canary_rollbacks_total") == 1

        # The survivor routes by the plan: nothing reaches the rolled-back canary.
        wait_for(lambda: survivor.metric("modelship_gateway_canary_weight") == 0, 20,
                 "the survivor to follow the rollback")  # fmt: skip
        on_canary = canary.num_requests()
        assert [complete(survivor, session + i) for i in range(10)] == [200] * 10
        assert canary.num_requests() == on_canary
    finally:
        for gateway in gateways:
            gateway.stop()
        canary.stop()
        stable.stop()
