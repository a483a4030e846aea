"""Every standalone gateway replica follows the release plan on the shared storage: two
real `modelship gateway --storage S --model M` processes in front of a stable and a canary
stand-in replica; the plan is changed with the real `modelship release` CLI, as an
operator would, and both gateways' traffic follows within a bounded wait."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from gateway_process import GatewayProcess
from modelship.release.traffic import read_traffic
from modelship.storage import Storage
from vllm_stand_in import VllmStandIn

from fleet_storage import placeholder_releases

SLUG = "tiny"
pytestmark = pytest.mark.timeout(180)


def release_cli(storage: Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "modelship", "release", *command, "--storage", str(storage),
         "--model", SLUG],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def send(gateway: GatewayProcess, sessions: range) -> None:
    for i in sessions:
        body = {"model": SLUG, "prompt": "hi", "max_tokens": 2}
        answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30,
                            headers={"x-session-id": f"s{i}"})  # fmt: skip
        assert answer.status_code == 200, answer.text


@contextmanager
def started(
    tmp_path: Path, *canary_args: str, gateway: dict | None = None
) -> Iterator[tuple[Path, VllmStandIn, VllmStandIn, list[GatewayProcess]]]:
    """Storage with production release 1 and release 2; a stable and a canary stand-in
    (`canary_args`: its flags); two gateways following the plan, each with `gateway` as
    its config and a folder of its own."""
    storage = placeholder_releases(tmp_path, SLUG)
    stable, canary = VllmStandIn(), VllmStandIn(*canary_args)
    gateways = []
    try:
        for name in ("a", "b"):
            folder = tmp_path / name
            folder.mkdir()
            gateways.append(GatewayProcess(
                folder, gateway or {}, "--engine", "vllm", "--endpoint", stable.url,
                "--canary-endpoint", canary.url, "--storage", str(storage.root), "--model", SLUG,
            ))  # fmt: skip
        for process in gateways:
            process.wait_ready(60)
        yield storage.root, stable, canary, gateways
    finally:
        for process in gateways:
            assert process.stop() == 0, process.log_tail()
        stable.stop()
        canary.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Path, VllmStandIn, VllmStandIn, list]]:
    with started(tmp_path) as parts:
        yield parts


def weights_are(gateways: list[GatewayProcess], weight: int) -> bool:
    return all(g.metric("modelship_gateway_canary_weight") == weight for g in gateways)


def test_rollback_and_promote_on_storage_reach_every_gateway(fleet) -> None:
    storage, stable, canary, gateways = fleet
    assert weights_are(gateways, 0)  # no canary in the plan: --canary-endpoint idles
    result = release_cli(storage, "canary", "--release", "2", "--weight", "50")
    assert result.returncode == 0, result.stderr
    wait_for(lambda: weights_are(gateways, 50), 20, "both gateways to read the canary")
    for gateway in gateways:
        before = len(canary.requests())
        send(gateway, range(30))
        assert len(canary.requests()) > before  # each gateway splits to the canary

    result = release_cli(storage, "rollback")
    assert result.returncode == 0, result.stderr
    wait_for(lambda: weights_are(gateways, 0), 20, "both gateways to read the rollback")
    on_canary, on_stable = len(canary.requests()), len(stable.requests())
    for gateway in gateways:
        send(gateway, range(30))
    assert len(canary.requests()) == on_canary
    assert len(stable.requests()) == on_stable + 60

    # A promotion: the canary track's replica serves production now, and takes it all.
    assert release_cli(storage, "canary", "--release", "2", "--weight", "20").returncode == 0
    wait_for(lambda: weights_are(gateways, 20), 20, "both gateways to read the new canary")
    result = release_cli(storage, "promote")
    assert result.returncode == 0, result.stderr
    wait_for(lambda: weights_are(gateways, 100), 20, "both gateways to read the promotion")
    on_canary, on_stable = len(canary.requests()), len(stable.requests())
    for gateway in gateways:
        send(gateway, range(20))
    assert len(stable.requests()) == on_stable
    assert len(canary.requests()) == on_canary + 40


def stream(gateway: GatewayProcess, session: str) -> None:
    """A streamed completion; a stream the canary cuts may end in an error: not asserted."""
    body = {"model": SLUG, "prompt": "hi", "max_tokens": 6, "stream": True}
    url, headers = f"{gateway.url}/v1/completions", {"x-session-id": session}
    with (
        contextlib.suppress(httpx.HTTPError),
        httpx.stream("POST", url, json=body, headers=headers, timeout=30) as answer,
    ):
        answer.read()


def test_one_gateways_traffic_judged_by_the_leader_reaches_both(tmp_path: Path) -> None:
    """The canary cuts every stream; only gateway a sends it traffic. a writes what it saw
    to storage, the leader (a or b) judges it and ends the canary on the plan, and both
    gateways follow; one rollback is counted, by the leader."""
    judge = {"canary": {"min_requests": 3, "window_s": 600}}
    with started(tmp_path, "--break-after", "1", gateway=judge) as parts:
        storage, _, _, (first, second) = parts
        result = release_cli(storage, "canary", "--release", "2", "--weight", "50")
        assert result.returncode == 0, result.stderr
        wait_for(lambda: weights_are([first, second], 50), 20, "both gateways to read it")
        for i in range(40):
            stream(first, f"s{i}")
            if read_traffic(Storage(storage), SLUG).canary is None:
                break
        wait_for(lambda: weights_are([first, second], 0), 20,
                 "both gateways to follow the judged rollback")  # fmt: skip
        rollbacks = [g.metric("modelship_gateway_canary_rollbacks_total") for g in parts[3]]
        leaders = [g.metric("modelship_gateway_leader") for g in parts[3]]
        assert rollbacks == leaders and sorted(rollbacks) == [0, 1]
        status = release_cli(storage, "status")
        assert "canary: none" in status.stdout and "auto_rollback release 2" in status.stdout
