"""Two `modelship gateway` processes sharing their decisions' inputs through a real
Redis-protocol server (`gateway.state`, `gateway/shared_decisions.py`), as two gateway
replicas on Kubernetes do:

- the canary split puts a session on the same track through either gateway (with no
  `canary.split_secret`, each would hash with a secret of its own);
- brown-out counts the requests in flight through the other gateway: one gateway holding
  the primary tier's whole capacity sends the other's requests to the cheaper tier (alone,
  each would see a primary with room).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gateway_process import GatewayProcess
from redis_process import RedisProcess
from vllm_stand_in import VllmStandIn

from bad_replica import BadReplica

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def start_gateway(
    tmp_path: Path, redis_server: RedisProcess
) -> Iterator[Callable[..., GatewayProcess]]:
    started: list[GatewayProcess] = []

    def start(config: dict, *endpoint_args: str) -> GatewayProcess:
        folder = tmp_path / f"gateway-{len(started)}"
        folder.mkdir()
        gateway = {**config, "state": redis_server.url}
        process = GatewayProcess(folder, gateway, *endpoint_args, "--engine", "vllm")
        started.append(process)
        process.wait_ready(60)
        return process

    yield start
    for process in started:
        process.stop()


def post(gateway: GatewayProcess, timeout_s: float = 30, **headers: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    return httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers,
                      timeout=timeout_s)  # fmt: skip


def test_a_session_keeps_its_track_through_either_gateway(start_gateway) -> None:
    stable, canary = VllmStandIn(), VllmStandIn()
    try:
        args = ("--endpoint", stable.url, "--canary-endpoint", canary.url,
                "--canary-weight", "50")  # fmt: skip
        gateways = [start_gateway({}, *args) for _ in range(2)]
        tracks: dict[str, set[str]] = {}
        for session in range(24):
            for gateway in gateways:
                answer = post(gateway, **{"x-session-id": f"session-{session}"})
                assert answer.status_code == 200, answer.text
                tracks.setdefault(f"session-{session}", set()).add(
                    answer.headers["x-modelship-release"]
                )
        assert all(len(seen) == 1 for seen in tracks.values()), tracks
        assert set.union(*tracks.values()) == {"stable", "canary"}  # the split splits
    finally:
        stable.stop()
        canary.stop()


def test_brownout_counts_the_requests_through_the_other_gateway(start_gateway) -> None:
    primary, cheap = BadReplica("hang"), VllmStandIn()  # the primary never answers
    config = {
        "tiers": [{"name": "cheap", "variant": "int4"}],
        "brownout": {"max_in_flight_per_replica": 2},
    }
    args = ("--endpoint", primary.url, "--tier-endpoint", f"cheap={cheap.url}")
    held: list[threading.Thread] = []
    try:
        first, second = (start_gateway(config, *args) for _ in range(2))
        for _ in range(2):  # the primary's capacity, held through the first gateway
            thread = threading.Thread(target=_hang_on, args=(first,), daemon=True)
            thread.start()
            held.append(thread)
        deadline = time.monotonic() + 20
        while primary.num_requests() < 2:
            assert time.monotonic() < deadline, "the first gateway's requests never arrived"
            time.sleep(0.05)
        # The second gateway has nothing in flight: only the first's load browns it out
        # (once its next exchange with the store brings it; bounded). A try that went to
        # the primary hangs; its client gives up and the gateway ends it.
        deadline = time.monotonic() + 20
        while True:
            try:
                answer = post(second, timeout_s=1.0)
            except httpx.TimeoutException:
                answer = None
            if answer is not None and answer.headers.get("x-modelship-tier") == "cheap":
                break
            assert time.monotonic() < deadline, "the second gateway never browned out"
        assert second.metric("modelship_gateway_tier_decisions_total", tier="cheap",
                             reason="brownout") >= 1  # fmt: skip
    finally:
        primary.stop()  # the held requests end
        cheap.stop()
        for thread in held:
            thread.join(timeout=30)


def _hang_on(gateway: GatewayProcess) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the primary stopped under it
        post(gateway, timeout_s=120)
