"""`modelship gateway` in front of replicas given by address (how Kubernetes runs it):
health checks, bad input, priority shedding and the queue cap, timeouts, a dead replica."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway_process import GatewayProcess
from modelship.config import ConfigError, ModelshipConfig
from modelship.gateway import hash_api_key
from modelship.gateway.canary import in_canary
from modelship.gateway.tiers import PRIMARY, TIER_HEADER
from modelship.server.process import bind_socket

from server_process import ServerProcess

MODEL = "tiny"
HIGH, LOW, PARTNER = "sk-high-test", "sk-low-test", "sk-partner-test"
METRICS_KEY = "sk-metrics-test"
METRICS_AUTH = {"authorization": f"Bearer {METRICS_KEY}"}
ADMIN_KEY = "sk-admin-test"
REPLICA_KEY = "sk-replica-test"  # tenants need replicas with a key (they trust it alone)
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def replica(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len", "2048",
        "--kv-cache-memory-mb", "32", "--enable-lora-admin", api_key=REPLICA_KEY,
    )  # fmt: skip
    yield process
    process.stop()


def tenants() -> list[dict]:
    return [
        {"name": "gold", "api_key_sha256": hash_api_key(HIGH), "priority": "high"},
        {"name": "batch", "api_key_sha256": hash_api_key(LOW), "priority": "low"},
    ]


@pytest.fixture
def start_gateway(tmp_path: Path):
    started: list[GatewayProcess] = []

    def start(endpoints: list[str], **gateway) -> GatewayProcess:
        config = {"tenants": tenants(), "metrics_api_key_sha256": hash_api_key(METRICS_KEY)}
        endpoint_args = [arg for url in endpoints for arg in ("--endpoint", url)]
        process = GatewayProcess(
            tmp_path, {**config, **gateway}, *endpoint_args, api_key=REPLICA_KEY
        )
        started.append(process)
        process.wait_ready(60)
        return process

    yield start
    for process in started:
        assert process.stop() == 0, process.log_tail()


def post(
    gateway: GatewayProcess,
    body,
    key: str = HIGH,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
):
    content = body if isinstance(body, bytes) else None
    return httpx.post(
        gateway.url + path,
        content=content,
        json=None if content else body,
        headers={
            "authorization": f"Bearer {key}",
            "content-type": "application/json",
            **(headers or {}),
        },
        timeout=60,
    )


def chat(max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, **extra}  # fmt: skip


def test_proxies_lists_models_and_reports_metrics(replica: ServerProcess, start_gateway):
    gateway = start_gateway([replica.url])
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=HIGH, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    answer = client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert answer.usage.completion_tokens == 3
    metrics = httpx.get(f"{gateway.url}/metrics", headers=METRICS_AUTH).text
    assert 'modelship_gateway_requests_total{release="stable",status="200",tenant="gold"' in (
        metrics
    )
    assert "modelship_gateway_routing_decisions_total" in metrics
    wrong = httpx.get(f"{gateway.url}/metrics", headers={"authorization": f"Bearer {HIGH}"})
    assert wrong.status_code == 401 and "gold" not in wrong.text


def test_public_metrics_show_the_fleet_not_the_requests(replica: ServerProcess, start_gateway):
    """Without the metrics key: fleet-wide health, the replicas' engine series summed over
    them included, and nothing that moves per request (tenants' usage, routing reasons:
    with those a tenant can watch what another sends)."""
    gateway = start_gateway([replica.url], resilience={"metrics_scrape_interval_s": 0.2})
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=HIGH, max_retries=0)
    client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    deadline = time.monotonic() + 30
    name = "modelship_gateway_replica_generation_tokens_total"
    while series(httpx.get(f"{gateway.url}/metrics").text, name) < 3:
        assert time.monotonic() < deadline, "the replica's generated tokens never showed"
        time.sleep(0.1)
    public = httpx.get(f"{gateway.url}/metrics").text
    for fleet_series in ("replicas", "queue_length", "breaker_state", "canary_weight",
                         "replica_num_requests_running", "replica_num_requests_waiting",
                         "replica_kv_cache_usage_perc", "replica_prefix_cache_hits_total",
                         "replica_prefix_cache_queries_total"):  # fmt: skip
        assert re.search(rf"^modelship_gateway_{fleet_series}[{{ ]", public, re.M), fleet_series
    for per_request in ("requests_total", "tokens_total", "cost_total", "routing_decisions",
                        "tier_decisions", "time_to_first_byte", "request_duration"):  # fmt: skip
        assert f"modelship_gateway_{per_request}" not in public, per_request
    assert "tenant=" not in public and "gold" not in public and MODEL not in public
    keyed = httpx.get(f"{gateway.url}/metrics", headers=METRICS_AUTH).text
    assert "modelship_gateway_routing_decisions_total{" in keyed
    assert series(keyed, name) >= 3  # the fleet's series are on the keyed page too


def test_routing_memory_is_per_tenant(replica: ServerProcess, start_gateway):
    """Tenant batch resends gold's prompt: no affinity hit, as a hit would confirm a guess
    at what gold sent (the replica's prefix cache is per tenant already); gold's own
    resend is one."""
    gateway = start_gateway([replica.url], routing={"policy": "prefix_affinity"})
    secret = "My account number is 4711-0815 and the vault code is 2203. " * 3
    body = {"model": MODEL, "prompt": secret, "max_tokens": 1}

    def hits() -> float:
        return metric(gateway, "modelship_gateway_routing_decisions_total", reason="affinity_hit")

    assert post(gateway, body, key=HIGH, path="/v1/completions").status_code == 200
    assert post(gateway, body, key=LOW, path="/v1/completions").status_code == 200
    assert hits() == 0
    assert post(gateway, body, key=HIGH, path="/v1/completions").status_code == 200
    assert hits() == 1


def test_bad_input_gets_openai_errors(replica: ServerProcess, start_gateway):
    gateway = start_gateway([replica.url])
    response = post(gateway, b"{not json")
    assert response.status_code == 400
    assert "parse the JSON" in response.json()["error"]["message"]
    response = post(gateway, {"model": MODEL})
    assert response.status_code == 400 and "messages" in response.json()["error"]["message"]
    response = post(gateway, chat(temperature=-3))  # the replica validates the rest
    assert response.status_code == 400 and "temperature" in response.json()["error"]["message"]
    response = httpx.get(f"{gateway.url}/v1/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_priority_shedding_then_queue_cap(replica: ServerProcess, start_gateway):
    gateway = start_gateway(
        [replica.url], admission={"max_requests": 2, "low_priority_fill": 0.5,
                                  "normal_priority_fill": 0.5},
    )  # fmt: skip
    long_stream = chat(max_tokens=1800, ignore_eos=True, stream=True)
    headers = {"authorization": f"Bearer {HIGH}"}
    url = f"{gateway.url}/v1/chat/completions"
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", url, json=long_stream, headers=headers) as first,
    ):
        first_chunks = first.iter_raw()  # kept: a dropped iterator closes the connection
        next(first_chunks)  # one request held: the gateway is half full
        shed = post(gateway, chat(), key=LOW)
        assert shed.status_code == 503
        assert shed.headers["retry-after"] == "1"
        assert "shedding low-priority" in shed.json()["error"]["message"]
        assert post(gateway, chat(), key=HIGH).status_code == 200
        with http.stream("POST", url, json=long_stream, headers=headers) as second:
            second_chunks = second.iter_raw()
            next(second_chunks)  # two held: full
            full = post(gateway, chat(), key=HIGH)
            assert full.status_code == 503
            assert "at capacity" in full.json()["error"]["message"]
    # Both clients hung up mid-stream: their slots are freed (and the replica's requests
    # aborted) as soon as the gateway sees the disconnects.
    deadline = time.monotonic() + 10
    held = 'modelship_gateway_queue_length{priority="high"} 0.0'
    while held not in httpx.get(f"{gateway.url}/metrics").text:
        assert time.monotonic() < deadline, "the slots of disconnected clients were not freed"
        time.sleep(0.05)
    assert post(gateway, chat(), key=LOW).status_code == 200
    metrics = httpx.get(f"{gateway.url}/metrics", headers=METRICS_AUTH).text
    assert 'modelship_gateway_rejections_total{reason="priority_shed",tenant="batch"} 1.0' in (
        metrics
    )


def test_slow_answer_is_a_504(replica: ServerProcess, start_gateway):
    gateway = start_gateway([replica.url], resilience={"request_timeout_s": 0.5})
    response = post(gateway, chat(max_tokens=1800, ignore_eos=True))
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout"
    assert post(gateway, chat()).status_code == 200


def test_dead_replica_is_routed_around(replica: ServerProcess, start_gateway):
    # Bound, never listening: connections are refused, and no other process can listen there.
    with bind_socket("127.0.0.1") as nothing_listens:
        dead = f"http://127.0.0.1:{nothing_listens.getsockname()[1]}"
        gateway = start_gateway([dead, replica.url], routing={"policy": "round_robin"})
        statuses = [
            post(gateway, chat(), path="/v1/chat/completions").status_code for _ in range(8)
        ]
        metrics = httpx.get(f"{gateway.url}/metrics").text
    assert statuses == [200] * 8
    # The dead one never passed a health check, so it was never tried.
    assert 'modelship_gateway_replicas{release="stable",state="unhealthy"' in metrics


def test_a_client_traceparent_is_linked_never_continued(replica: ServerProcess, tmp_path: Path):
    """A client's sampled `traceparent` neither makes a gateway with `sample_ratio: 0` write
    spans (naming the tenant) under the client's trace id, nor parents the gateway's spans
    when it does sample: the gateway's trace is its own, the client's linked."""
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    traceparent = f"00-{client_trace}-{client_span}-01"  # the sampled flag set
    spans = tmp_path / "spans.jsonl"

    def traced_request(ratio: float) -> list[dict]:
        tracing = {"exporter": "file", "file": str(spans), "sample_ratio": ratio}
        gateway = GatewayProcess(tmp_path, {"tenants": tenants()}, "--endpoint", replica.url,
                                 api_key=REPLICA_KEY, sections={"tracing": tracing})  # fmt: skip
        try:
            gateway.wait_ready(60)
            response = post(gateway, chat(), headers={"traceparent": traceparent})
            assert response.status_code == 200
        finally:
            assert gateway.stop() == 0, gateway.log_tail()  # exports what is pending
        lines = spans.read_text().splitlines() if spans.exists() else []
        return [json.loads(line) for line in lines]

    assert traced_request(0.0) == []
    (request,) = [s for s in traced_request(1.0) if s["name"] == "gateway request"]
    assert request["trace_id"] != client_trace and request["parent_span_id"] is None
    assert request["links"] == [{"trace_id": client_trace, "span_id": client_span}]
    assert request["attributes"]["tenant"] == "gold"


def test_one_tenant_cannot_roll_back_a_healthy_canary(replica: ServerProcess, tmp_path: Path):
    """Tenant batch, knowing which of its sessions the split sends to the canary (the
    release header told it; here the test's own copy of the split), sends those long
    non-streaming answers and its stable sessions one-token ones. The judge took each
    answer's whole time for its TTFT and rolled the (same, healthy) replica's canary
    back; now it judges first-token times of streams, and no one tenant alone. Only the
    operator's key hears which release answered."""
    secret = "split-secret-for-the-test-0123"
    gateway_config = {
        "tenants": [*tenants(), {"name": "ops", "api_key_sha256": hash_api_key(METRICS_KEY)}],
        "metrics_api_key_sha256": hash_api_key(METRICS_KEY),
        "canary": {"split_secret": secret, "min_requests": 4, "window_s": 600,
                   "max_ttft_p95_ratio": 1.5, "min_ttft_increase_s": 0.02},
    }  # fmt: skip
    gateway = GatewayProcess(tmp_path, gateway_config, "--endpoint", replica.url,
                             "--canary-endpoint", replica.url, "--canary-weight", "50",
                             api_key=REPLICA_KEY)  # fmt: skip
    gateway.metrics_key = METRICS_KEY
    split_key = hashlib.sha256(secret.encode()).digest()
    sessions = {True: [], False: []}
    for i in range(40):
        sessions[in_canary(f"batch\nsession:s{i}", 50, split_key)].append(f"s{i}")
    told: list[str | None] = []
    try:
        gateway.wait_ready(60)
        for canary_session, stable_session in zip(
            sessions[True][:6], sessions[False][:6], strict=True
        ):
            slow = chat(max_tokens=60, ignore_eos=True)
            answer = post(gateway, slow, key=LOW, headers={"x-session-id": canary_session})
            assert answer.status_code == 200
            told.append(answer.headers.get("x-modelship-release"))
            fast = post(gateway, chat(max_tokens=1), key=LOW,
                        headers={"x-session-id": stable_session})  # fmt: skip
            assert fast.status_code == 200
        assert gateway.metric("modelship_gateway_canary_rollbacks_total") == 0
        assert gateway.metric("modelship_gateway_canary_weight") == 50
        assert told == [None] * 6  # a tenant is not told its track
        operator = post(gateway, chat(), key=METRICS_KEY)
        assert operator.headers["x-modelship-release"] in ("stable", "canary")
    finally:
        assert gateway.stop() == 0, gateway.log_tail()


def test_gateway_without_endpoints_exits_2(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "modelship", "gateway"],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "MODELSHIP_GATEWAY_ENDPOINTS": ""},
    )  # fmt: skip
    assert result.returncode == 2
    assert "--endpoint" in result.stderr


def test_tenant_config_errors_name_the_field_and_never_echo_keys():
    with pytest.raises(ConfigError) as info:
        ModelshipConfig.from_dict(
            {"gateway": {"tenants": [{"name": "t", "api_key_sha256": "sk-very-secret-key"}]}}
        )
    message = str(info.value)
    assert "gateway.tenants.0.api_key_sha256" in message
    assert "sk-very-secret-key" not in message
    with pytest.raises(ConfigError) as info:
        ModelshipConfig.from_dict({"gateway": {"metrics_api_key_sha256": "sk-metrics-secret"}})
    assert "gateway.metrics_api_key_sha256" in str(info.value)
    assert "sk-metrics-secret" not in str(info.value)


def test_token_id_prompts_are_served_and_odd_prompts_are_400s(
    replica: ServerProcess, start_gateway
):
    gateway = start_gateway([replica.url])
    for prompt in ([1, 2, 3], [[1, 2, 3], [4, 5]], ["one", "two"]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        response = post(gateway, body, path="/v1/completions")
        assert response.status_code == 200, response.text
        answer = response.json()
        num_prompts = len(prompt) if isinstance(prompt[0], list | str) else 1
        assert len(answer["choices"]) == num_prompts
        if prompt == [1, 2, 3]:
            assert answer["usage"]["prompt_tokens"] == 3
    for prompt in ([1, "two"], [[1], "two"], [True, 2], [], {"a": 1}, 3, [[1, [2]]]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        response = post(gateway, body, path="/v1/completions")
        assert response.status_code == 400, (prompt, response.text)
        assert "prompt" in response.json()["error"]["message"]
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = post(gateway, deep, path="/v1/completions")
    assert response.status_code == 400 and response.json()["error"]["type"]
    response = post(gateway, chat(stream="yes"))
    assert response.status_code == 400 and "stream" in response.json()["error"]["message"]


def test_n_and_stop_are_capped_and_every_sequence_holds_a_slot(
    replica: ServerProcess, start_gateway
):
    small = {"name": "small", "api_key_sha256": hash_api_key("sk-small"), "max_concurrent": 2}
    gateway = start_gateway(
        [replica.url],
        tenants=[*tenants(), small],
        admission={"max_requests": 4},
        request_limits={"max_n": 4, "max_stop": 2, "max_stop_chars": 8},
    )
    refused = [({"n": 5}, "n"), ({"n": 0}, "n"), ({"n": "2"}, "n"), ({"stop": ["a", "b", "c"]},
               "stop"), ({"stop": "x" * 9}, "stop"), ({"stop": [1]}, "stop")]  # fmt: skip
    for extra, field in refused:
        response = post(gateway, chat(**extra))
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["message"].startswith(f"{field}:")
    answer = post(gateway, chat(n=4, stop=["a", "b"]))
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 4
    response = post(gateway, chat(n=3), key="sk-small")  # more than the key's concurrency
    assert response.status_code == 400 and response.json()["error"]["code"] == "max_concurrent"
    completion = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 2}
    response = post(gateway, completion, key="sk-small", path="/v1/completions")
    assert response.status_code == 400  # two prompts x n=2: four sequences

    # A stream of three sequences holds three of the gateway's four slots.
    headers = {"authorization": f"Bearer {HIGH}"}
    long_stream = chat(max_tokens=1800, ignore_eos=True, stream=True, n=3)
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{gateway.url}/v1/chat/completions", json=long_stream,
                    headers=headers) as held,
    ):  # fmt: skip
        chunks = held.iter_raw()
        next(chunks)
        full = post(gateway, chat(n=2))
        assert full.status_code == 503 and "at capacity" in full.json()["error"]["message"]
        assert post(gateway, chat()).status_code == 200


def series(text: str, name: str) -> float:
    """Sum of the samples named `name` in a /metrics page."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    text = httpx.get(f"{gateway.url}/metrics", headers=METRICS_AUTH, timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def wait_until_idle(gateway: GatewayProcess) -> None:
    deadline = time.monotonic() + 30
    while metric(gateway, "modelship_gateway_queue_length") > 0:
        assert time.monotonic() < deadline, "the gateway still holds requests"
        time.sleep(0.05)


def test_only_replica_faults_open_the_breaker(replica: ServerProcess, start_gateway):
    # One failure would open the breaker, and with one replica every later request is a 503.
    gateway = start_gateway([replica.url], resilience={"breaker_failure_threshold": 1})
    url = f"{gateway.url}/v1/chat/completions"
    headers = {"authorization": f"Bearer {HIGH}"}
    long_answer = chat(max_tokens=1800, ignore_eos=True)
    # A client hanging up mid-stream...
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", url, json={**long_answer, "stream": True}, headers=headers) as s,
    ):
        next(s.iter_raw())
    # ... and one giving up on a long non-streaming answer.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=long_answer, headers=headers, timeout=httpx.Timeout(60, read=0.3))
    # ... and one gone before its whole body arrived.
    with socket.create_connection((gateway.host, gateway.port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
            + f"authorization: Bearer {HIGH}\r\n".encode()
            + b'content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"model"'
        )
    wait_until_idle(gateway)
    deadline = time.monotonic() + 30
    while metric(gateway, "modelship_gateway_requests_total", status="499") < 3:
        assert time.monotonic() < deadline, "a client's hang-up was not recorded as a 499"
        time.sleep(0.05)
    # A request the replica refuses as bad input.
    assert post(gateway, chat(temperature=-3)).status_code == 400

    assert metric(gateway, "modelship_gateway_breaker_opened_total") == 0
    assert metric(gateway, "modelship_gateway_upstream_failures_total") == 0
    assert metric(gateway, "modelship_gateway_breaker_state", state="closed") == 1
    assert post(gateway, chat()).status_code == 200


def test_a_long_answer_is_not_cut_by_the_first_byte_timeout(replica: ServerProcess, start_gateway):
    # A non-streaming answer's first byte comes when generation ends: only the request
    # timeout bounds it.
    gateway = start_gateway(
        [replica.url], resilience={"first_byte_timeout_s": 0.05, "request_timeout_s": 120}
    )
    response = post(gateway, chat(max_tokens=600, ignore_eos=True))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 600


def charged(gateway: GatewayProcess) -> tuple[float, float]:
    """The gold tenant's charged (input, output) tokens so far."""
    return tuple(
        metric(gateway, "modelship_gateway_tokens_total", tenant="gold", kind=kind)
        for kind in ("input", "output")
    )


def test_tenants_are_charged_the_tokens_the_replica_counted(replica: ServerProcess, start_gateway):
    gateway = start_gateway([replica.url])
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=HIGH, max_retries=0)
    # Digits are about a token each: far more than the gateway's characters / 4.
    messages = [{"role": "user", "content": " ".join("7" * 200)}]

    def ask(**extra):
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=9, extra_body={"ignore_eos": True},
            **extra,
        )  # fmt: skip

    before = charged(gateway)
    chunks = list(ask(stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.completion_tokens == 9 and usage.prompt_tokens > 200
    after = charged(gateway)
    assert (after[0] - before[0], after[1] - before[1]) == (usage.prompt_tokens, 9)

    # A client that did not ask for usage gets none, and is charged all the same.
    chunks = list(ask(stream=True))
    assert all(chunk.usage is None and chunk.choices for chunk in chunks)
    again = charged(gateway)
    assert (again[0] - after[0], again[1] - after[1]) == (usage.prompt_tokens, 9)

    answer = ask()
    final = charged(gateway)
    assert answer.usage.prompt_tokens == usage.prompt_tokens
    assert (final[0] - again[0], final[1] - again[1]) == (usage.prompt_tokens, 9)

    # A stream cut short is charged for what came through before the cut (and its input
    # as estimated: no usage came).
    headers = {"authorization": f"Bearer {HIGH}"}
    body = {"model": MODEL, "messages": messages, "max_tokens": 1500, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{gateway.url}/v1/chat/completions", json=body,
                    headers=headers) as stream,
    ):  # fmt: skip
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(12), strict=False) if line) >= 5
    wait_until_idle(gateway)
    cut = charged(gateway)
    assert cut[0] - final[0] > 0
    assert 5 <= cut[1] - final[1] < 1500


def test_responses_are_authenticated_charged_and_refused_like_chat(
    replica: ServerProcess, start_gateway
):
    """/v1/responses through the gateway: the tenant's key, its charge in tokens the
    replica counted (whole and streamed), and a field the gateway cannot honour refused
    by name before any replica sees it."""
    gateway = start_gateway([replica.url])
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=HIGH, max_retries=0)

    before = charged(gateway)
    whole = client.responses.create(model=MODEL, input=" ".join("7" * 50), max_output_tokens=5,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert whole.status == "incomplete" and whole.usage.output_tokens == 5
    after = charged(gateway)
    assert (after[0] - before[0], after[1] - before[1]) == (whole.usage.input_tokens, 5)
    stream = client.responses.create(
        model=MODEL,
        input=" ".join("7" * 50),
        stream=True,
        max_output_tokens=5,
        extra_body={"ignore_eos": True},
    )
    events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.usage.output_tokens == 5
    again = charged(gateway)
    assert (again[0] - after[0], again[1] - after[1]) == (whole.usage.input_tokens, 5)

    refused = post(gateway, {"model": MODEL, "input": "hi", "previous_response_id": "r"},
                   path="/v1/responses")  # fmt: skip
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "previous_response_id"
    unknown = post(gateway, {"model": MODEL, "input": "hi"}, key="sk-nobody", path="/v1/responses")
    assert unknown.status_code == 401
    assert post(gateway, b"{not json", path="/v1/responses").status_code == 400


def test_embeddings_through_the_gateway_are_charged_as_input(replica: ServerProcess, start_gateway):
    gateway = start_gateway([replica.url])
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=HIGH, max_retries=0)

    before = charged(gateway)
    answer = client.embeddings.create(model=MODEL, input=["hello world", " ".join("7" * 40)])
    assert len(answer.data) == 2 and len(answer.data[0].embedding) == 64
    after = charged(gateway)
    assert (after[0] - before[0], after[1] - before[1]) == (answer.usage.prompt_tokens, 0)
    refused = post(gateway, {"model": MODEL, "input": {"x": 1}}, path="/v1/embeddings")
    assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("input")


def test_an_admin_changes_adapters_on_every_replica_given_by_address(
    start_gateway, replica: ServerProcess, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from tiny_models import make_tiny_lora

    roots = tmp_path / "adapters"
    adapter = str(make_tiny_lora(tiny_llama_dir, roots / "adapter", 4, ["q_proj"], seed=9))
    closed = start_gateway([replica.url])
    off = post(closed, {"lora_name": "x", "lora_path": adapter}, ADMIN_KEY,
               "/v1/load_lora_adapter")  # fmt: skip
    assert off.status_code == 404 and "admin_api_key_sha256" in off.json()["error"]["message"]
    gateway = start_gateway([replica.url], admin_api_key_sha256=hash_api_key(ADMIN_KEY),
                            adapter_roots=[str(roots)])  # fmt: skip

    def load(name: str, path: str) -> httpx.Response:
        return post(gateway, {"lora_name": name, "lora_path": path}, ADMIN_KEY,
                    "/v1/load_lora_adapter")  # fmt: skip

    body = {"lora_name": "extra", "lora_path": adapter}
    assert post(gateway, body, HIGH, "/v1/load_lora_adapter").status_code == 403
    loaded = load("extra", adapter)
    assert loaded.status_code == 200
    assert loaded.json()["replicas"] == [
        {"replica": "stable-0", "status_code": 200, "result": "loaded"}
    ]
    answer = post(gateway, {**chat(), "model": "extra"})
    assert answer.status_code == 200 and answer.json()["model"] == "extra"
    again = load("extra", adapter)  # repeating a call is safe
    assert again.status_code == 200
    assert again.json()["replicas"][0]["result"] == "already_loaded"
    # Refusals a replica makes are the answer, never "loaded": the model's own name, and a
    # name already served from another folder (one name, two sets of weights).
    other = str(make_tiny_lora(tiny_llama_dir, roots / "other", 4, ["v_proj"], seed=10))
    for name in (MODEL, "extra"):
        taken = load(name, other)
        assert taken.status_code == 409, taken.text
        assert "done on 0 of 1" in taken.json()["error"]["message"]
        assert taken.json()["replicas"][0]["status_code"] == 409
    # The gateway's own checks: the name (a `=` breaks `--lora NAME=PATH`), the folder.
    for name in ("a=b", "x" * 65, "with space"):
        bad = load(name, other)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_name"
    for path in ("/nonexistent", f"{roots}/../{Path(adapter).name}", str(roots), "relative"):
        outside = load("outside", path)
        assert outside.status_code == 403 and outside.json()["error"]["param"] == "lora_path"
    unloaded = post(gateway, {"lora_name": "extra"}, ADMIN_KEY, "/v1/unload_lora_adapter")
    assert unloaded.status_code == 200
    assert unloaded.json()["replicas"][0]["result"] == "unloaded"
    assert post(gateway, {**chat(), "model": "extra"}).status_code == 404
    gone = post(gateway, {"lora_name": "extra"}, ADMIN_KEY, "/v1/unload_lora_adapter")
    assert gone.status_code == 404 and gone.json()["replicas"][0]["result"] == "not_loaded"


def test_tier_replicas_given_by_address(replica: ServerProcess, tmp_path: Path):
    partner = {"name": "partner", "api_key_sha256": hash_api_key(PARTNER), "priority": "low",
               "may_request_tiers": ["primary"]}  # fmt: skip
    tiers = {
        "tenants": [*tenants(), partner],
        "tiers": [{"name": "economy", "variant": "int4"}],
        "tier_rules": [{"name": "short", "tier": "economy", "max_output_tokens": 4}],
        "metrics_api_key_sha256": hash_api_key(METRICS_KEY),
    }
    gateway = GatewayProcess(tmp_path, tiers, "--endpoint", replica.url,
                             "--tier-endpoint", f"economy={replica.url}",
                             api_key=REPLICA_KEY)  # fmt: skip
    gateway.metrics_key = METRICS_KEY
    try:
        gateway.wait_ready(60)
        c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=LOW, max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        # The tier's variant is configured; the primary's is what the replica says it serves.
        for max_tokens, tier, variant in [(4, "economy", "int4"), (8, "primary", "base")]:
            response = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=max_tokens
            )
            headers = response.headers
            assert (headers["x-modelship-tier"], headers["x-modelship-variant"]) == (tier, variant)
        assert gateway.metric("modelship_gateway_tier_decisions_total", reason="short") == 1

        # The rule's tier binds: naming the dearer primary does not escape it (denied) ...
        def tier_for(key: str) -> str:
            response = post(gateway, chat(max_tokens=4), key=key, headers={TIER_HEADER: PRIMARY})
            assert response.status_code == 200
            return response.headers[TIER_HEADER]

        assert tier_for(LOW) == "economy"
        assert gateway.metric("modelship_gateway_tier_decisions_total", reason="denied") == 1
        # ... unless the tenant may name it
        assert tier_for(PARTNER) == PRIMARY
    finally:
        gateway.stop()

    bad = subprocess.run(
        [sys.executable, "-m", "modelship", "gateway", "--config", str(tmp_path / "pipeline.yaml"),
         "--endpoint", replica.url, "--tier-endpoint", f"gold={replica.url}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "'gold=" in bad.stderr and "one of gateway.tiers (economy)" in bad.stderr
