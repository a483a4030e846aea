"""`modelship gateway --engine vllm` in front of replicas that answer as vLLM does
(`vllm_stand_in.py`): checked on /health (vLLM has no /ready), tenants' classes sent in
vLLM's priority order, vLLM's error bodies passed on, and no stream resumed on a vLLM
replica (it would ignore `resume_token_ids` and start the answer over)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway_process import GatewayProcess
from modelship.gateway import hash_api_key
from vllm_stand_in import VllmStandIn

MODEL = "tiny"
HIGH, NORMAL, LOW = "sk-high-test", "sk-normal-test", "sk-low-test"
pytestmark = pytest.mark.timeout(120)


def tenants() -> list[dict]:
    return [
        {"name": "gold", "api_key_sha256": hash_api_key(HIGH), "priority": "high"},
        {"name": "plain", "api_key_sha256": hash_api_key(NORMAL)},
        {"name": "batch", "api_key_sha256": hash_api_key(LOW), "priority": "low"},
    ]


@pytest.fixture
def start(tmp_path: Path) -> Iterator:
    started: list[VllmStandIn | GatewayProcess] = []

    def start_gateway(replicas: list[VllmStandIn]) -> GatewayProcess:
        endpoints = [arg for replica in replicas for arg in ("--endpoint", replica.url)]
        # The replicas' key: a gateway with tenants refuses to start without one.
        gateway = GatewayProcess(tmp_path, {"tenants": tenants()}, "--engine", "vllm",
                                 *endpoints, api_key="sk-replica-test")  # fmt: skip
        started.append(gateway)
        gateway.wait_ready(60)  # the replicas' /health answered
        return gateway

    def start_replica(*args: str) -> VllmStandIn:
        replica = VllmStandIn(*args)
        started.append(replica)
        return replica

    yield start_gateway, start_replica
    for process in reversed(started):
        process.stop()


def sdk(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)


def test_a_vllm_replica_is_routed_to_in_its_priority_order(start) -> None:
    start_gateway, start_replica = start
    replica = start_replica("--scheduling-policy", "priority")
    gateway = start_gateway([replica])
    for key in (HIGH, NORMAL, LOW):
        answer = sdk(gateway, key).completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert answer.choices[0].text == " one two three"
    # vLLM schedules lower values first: the high class is sent as -1, the low one as 1.
    assert [body["priority"] for body in replica.requests()] == [-1, 0, 1]


def test_vllm_refusals_pass_through_and_leave_the_replica_routable(start) -> None:
    start_gateway, start_replica = start
    replica = start_replica()  # no --scheduling-policy priority: only priority 0 passes
    gateway = start_gateway([replica])
    with pytest.raises(openai.BadRequestError, match="Priority scheduling is not enabled"):
        sdk(gateway, HIGH).completions.create(model=MODEL, prompt="hi", max_tokens=3)
    for _ in range(4):  # the request's fault, not the replica's: no breaker opens
        answer = sdk(gateway, NORMAL).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert answer.usage.completion_tokens == 2


def test_a_stream_is_never_resumed_on_a_vllm_replica(start) -> None:
    start_gateway, start_replica = start
    replicas = [start_replica("--scheduling-policy", "priority", "--break-after", "2")
                for _ in range(2)]  # fmt: skip
    gateway = start_gateway(replicas)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 6, "stream": True}
    headers = {"authorization": f"Bearer {NORMAL}"}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, headers=headers,
                      timeout=30) as stream:  # fmt: skip
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    text = "".join(line for line in events if '"text"' in line)
    assert text.count('" one"') == 1  # the answer was not started over elsewhere
    assert "error" in events[-1]  # the stream ends with an error event
    received = [request for replica in replicas for request in replica.requests()]
    assert len(received) == 1, received
    assert "resume_token_ids" not in received[0] and "return_token_ids" not in received[0]
