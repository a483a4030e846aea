"""Replica faults the fleet drill (benchmarks/drill/fleet_faults.py) found reaching
clients, through `modelship gateway` in front of a real replica and a misbehaving one
(`bad_replica.py`, a real HTTP server): a replica answering 500s or garbage, a hung
replica, a canary that fails every request, a gateway restarted under load."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gateway_process import GatewayProcess
from modelship.gateway.config import GatewayConfig
from modelship.gateway.groups import STABLE
from modelship.gateway.pool import EndpointPool, static_upstreams
from modelship.gateway.service import GatewayService
from modelship.server.process import bind_socket

from bad_replica import BadReplica
from server_process import ServerProcess

MODEL = "tiny"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def replica(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len", "256",
        "--kv-cache-memory-mb", "16",
    )  # fmt: skip
    yield process
    process.stop()


@pytest.fixture
def bad_replicas() -> Iterator[list[BadReplica]]:
    started: list[BadReplica] = []
    yield started
    for bad in started:
        bad.stop()


@pytest.fixture
def start_gateway(tmp_path: Path):
    started: list[GatewayProcess] = []

    def start(gateway: dict, *endpoint_args: str) -> GatewayProcess:
        process = GatewayProcess(tmp_path, gateway, *endpoint_args)
        started.append(process)
        process.wait_ready(60)
        return process

    yield start
    for process in started:
        assert process.stop() == 0, process.log_tail()


def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=60)


def ask(gateway: GatewayProcess, stream: bool, user: str = "u") -> str:
    """The answer's text; raises what the SDK raises (an error status, an error event)."""
    messages = [{"role": "user", "content": "tell me a story"}]
    answer = client(gateway).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, stream=stream, user=user
    )
    if not stream:
        assert answer.choices[0].finish_reason in ("stop", "length")
        return answer.choices[0].message.content or ""
    chunks = list(answer)
    assert any(c.choices and c.choices[0].finish_reason for c in chunks), "cut short silently"
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("mode", ["500", "garbage"])
def test_a_replica_answering_errors_or_garbage_is_ejected_and_clients_see_answers(
    replica: ServerProcess, bad_replicas: list[BadReplica], start_gateway, mode: str
) -> None:
    """500s reached clients until the breaker opened (500 was not retried); a 200 with a
    body cut short reached them as invalid JSON, and as a stream with no event at all,
    which the SDK ends silently; neither counted against the breaker."""
    bad = BadReplica(mode)
    bad_replicas.append(bad)
    gateway = start_gateway(
        {"routing": {"policy": "round_robin"},
         "resilience": {"breaker_failure_threshold": 2, "breaker_cool_down_s": 120}},
        "--endpoint", bad.url, "--endpoint", replica.url,
    )  # fmt: skip
    for i in range(8):
        ask(gateway, stream=i % 2 == 1)
    assert bad.num_requests() == 2  # then its breaker opened
    assert gateway.metric("modelship_gateway_breaker_opened_total", endpoint="stable-0") == 1
    assert gateway.metric("modelship_gateway_breaker_opened_total", endpoint="stable-1") == 0
    kind = "status" if mode == "500" else "invalid"
    assert gateway.metric("modelship_gateway_retries_total", kind=kind) == 2


def test_requests_waiting_on_a_hung_replica_are_retried_elsewhere(
    replica: ServerProcess, bad_replicas: list[BadReplica], start_gateway
) -> None:
    """A non-streaming request sent to a replica that then hung (SIGSTOP) waited for the
    whole request timeout and failed with a 504; now the health checks' silence abandons
    it before any byte of an answer, and another replica answers."""
    hung = BadReplica("hang")  # takes requests and never answers them
    bad_replicas.append(hung)
    request_timeout_s = 60.0
    gateway = start_gateway(
        {"routing": {"policy": "round_robin"},
         "resilience": {"health_check_interval_s": 0.2, "connect_timeout_s": 0.5,
                        "request_timeout_s": request_timeout_s}},
        "--endpoint", hung.url, "--endpoint", replica.url,
    )  # fmt: skip
    answers: list[tuple[bool, float]] = []

    def send(stream: bool) -> None:
        started = time.monotonic()
        ask(gateway, stream)
        answers.append((stream, time.monotonic() - started))

    threads = [threading.Thread(target=send, args=(s,)) for s in (False, True, False, True)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while hung.num_requests() < 2:  # round robin: half of them wait on it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    hung.pause()  # now its health checks go unanswered too
    for thread in threads:
        thread.join(timeout=request_timeout_s)
    assert len(answers) == 4, "a request failed"
    assert max(seconds for _, seconds in answers) < request_timeout_s / 3
    assert gateway.metric("modelship_gateway_retries_total", kind="unresponsive") == 2


def test_a_failing_canary_falls_back_to_stable_and_is_rolled_back(
    replica: ServerProcess, bad_replicas: list[BadReplica], start_gateway
) -> None:
    """A canary answering 500s: its requests failed (no retry outside the canary track),
    and once its breaker opened the split sent its share to stable unrecorded, so the
    judge never reached `min_requests` and never rolled it back."""
    bad = BadReplica("500")
    bad_replicas.append(bad)
    gateway = start_gateway(
        {"canary": {"min_requests": 5, "window_s": 600},
         "resilience": {"breaker_failure_threshold": 2, "breaker_cool_down_s": 120}},
        "--endpoint", replica.url, "--canary-endpoint", bad.url, "--canary-weight", "50",
    )  # fmt: skip
    for i in range(40):
        ask(gateway, stream=i % 2 == 1, user=f"user-{i}")  # every one answered
        if gateway.metric("modelship_gateway_canary_rollbacks_total") == 1:
            break
    assert gateway.metric("modelship_gateway_canary_rollbacks_total") == 1
    assert gateway.metric("modelship_gateway_canary_weight") == 0
    assert bad.num_requests() == 2  # its breaker opened; the rest were counted, not sent


def test_a_started_gateway_already_knows_which_replicas_answer(
    bad_replicas: list[BadReplica],
) -> None:
    """Restarted under load, `modelship gateway` answered its first requests 503 ("no
    replica is ready"): it listened before its first health check (static replicas start
    unhealthy). The first round of checks now runs before the app's startup ends, which
    uvicorn waits for before it listens."""
    answering = BadReplica("500")  # its /ready answers 200
    bad_replicas.append(answering)
    config = GatewayConfig()
    pool = EndpointPool(config.resilience)
    # Bound, never listening: connections are refused, and no other process can listen there.
    with bind_socket("127.0.0.1") as nothing_listens:
        silent = f"http://127.0.0.1:{nothing_listens.getsockname()[1]}"
        static_upstreams(pool, [answering.url, silent], STABLE, "stable")
        service = GatewayService(config, pool)

        async def start() -> tuple[bool, list[bool]]:
            await service.start()
            try:
                return service.is_ready(), [upstream.is_healthy for upstream in pool]
            finally:
                await service.close()

        assert asyncio.run(start()) == (True, [True, False])
