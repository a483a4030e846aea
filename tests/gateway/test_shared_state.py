"""Two `modelship gateway` processes sharing their tenants' quotas through a real
Redis-protocol server (`gateway.state`), in front of a vLLM stand-in, as two gateway
replicas on Kubernetes do:

- a tenant's requests per minute hold across both gateways (in memory, each would admit
  the whole budget);
- the server lost, the gateway with `state_failure: closed` refuses quota'd requests
  (503, Retry-After) and the one with `open` admits them, each counting the failure and
  logging it; once the server is back, the quotas are kept again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from gateway_process import GatewayProcess
from modelship.gateway import hash_api_key
from redis_process import RedisProcess
from vllm_stand_in import VllmStandIn

REPLICA_KEY = "sk-replica-state"
METERED, CAPPED = "sk-metered-tenant", "sk-capped-tenant"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def replica() -> Iterator[VllmStandIn]:
    server = VllmStandIn()
    yield server
    server.stop()


def start_gateway(tmp_path: Path, replica: VllmStandIn, state: str, failure: str):
    tenants = [
        {"name": "metered", "api_key_sha256": hash_api_key(METERED), "requests_per_minute": 10},
        {"name": "capped", "api_key_sha256": hash_api_key(CAPPED), "max_concurrent": 8},
    ]
    gateway = {"tenants": tenants, "state": state, "state_failure": failure}
    process = GatewayProcess(
        tmp_path, gateway, "--endpoint", replica.url, "--engine", "vllm", api_key=REPLICA_KEY
    )
    process.wait_ready(60)
    return process


@pytest.fixture(scope="module")
def gateways(
    redis_server: RedisProcess, replica: VllmStandIn, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    closed = start_gateway(tmp_path_factory.mktemp("closed"), replica, redis_server.url, "closed")
    try:
        opened = start_gateway(tmp_path_factory.mktemp("open"), replica, redis_server.url, "open")
    except BaseException:
        closed.stop()
        raise
    yield closed, opened
    for process in (closed, opened):
        assert process.stop() == 0, process.log_tail()


def post(gateway: GatewayProcess, key: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=30)


def test_a_tenants_requests_per_minute_hold_across_both_gateways(
    gateways: tuple[GatewayProcess, GatewayProcess],
) -> None:
    started = time.monotonic()
    answers = [post(gateway, METERED) for _ in range(10) for gateway in gateways]
    elapsed_s = time.monotonic() - started
    statuses = [answer.status_code for answer in answers]
    assert set(statuses) == {200, 429}, statuses
    # 10 a minute, plus one for each 6 s the burst took: in memory each gateway would have
    # admitted 10, all 20.
    assert 10 <= statuses.count(200) <= 10 + int(elapsed_s / 6), (statuses, elapsed_s)
    refused = next(answer for answer in answers if answer.status_code == 429)
    assert refused.json()["error"]["message"] == "at most 10 requests per minute"
    assert int(refused.headers["retry-after"]) >= 1


def test_a_lost_store_refuses_when_closed_and_admits_when_open(
    gateways: tuple[GatewayProcess, GatewayProcess], redis_server: RedisProcess
) -> None:
    closed, opened = gateways
    assert post(closed, CAPPED).status_code == 200
    redis_server.stop()  # killed: lost, as a crashed or unreachable Redis
    try:
        refused = post(closed, CAPPED)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "state_unavailable" and "gateway.state" in error["message"]
        assert refused.headers["retry-after"] == "1"
        assert post(opened, CAPPED).status_code == 200
        for gateway in gateways:
            failures = gateway.metric("modelship_gateway_state_failures_total", operation="admit")
            assert failures >= 1
            assert "tenant quota store did not answer" in gateway.log_tail(200)
    finally:
        redis_server.start()
    for _ in range(50):  # a connection the store dropped may fail once more; bounded
        if post(closed, CAPPED).status_code == 200:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the closed gateway never admitted again:\n" + closed.log_tail())
    assert "answers again" in closed.log_tail(200)


def test_a_store_url_is_checked_and_its_password_never_shown(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump({"gateway": {"state": "http://user:hunter2@cache:6379"}}))
    env = {**os.environ, "MODELSHIP_API_KEY": REPLICA_KEY}
    in_file = run_gateway("--config", str(config), env=env)
    assert in_file.returncode == 2 and "gateway.state" in in_file.stderr
    env["MODELSHIP_GATEWAY_STATE"] = "http://user:hunter2@cache:6379"
    from_env = run_gateway(env=env)
    assert from_env.returncode == 2 and "--state" in from_env.stderr
    for result in (in_file, from_env):
        assert "scheme 'http'" in result.stderr and "hunter2" not in result.stdout + result.stderr


def run_gateway(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "modelship", "gateway", "--endpoint",
               "http://127.0.0.1:9", *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
