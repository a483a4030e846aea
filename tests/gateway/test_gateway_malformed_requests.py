"""Requests the fuzz drill (benchmarks/drill/fuzz.py) found the gateway answering with a 500
or a plain-text body, answered in-process (no replica is ever asked)."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from modelship.gateway.app import create_gateway_app
from modelship.gateway.config import GatewayConfig, RequestLimitsConfig
from modelship.gateway.pool import EndpointPool
from modelship.gateway.request import GatewayError, parse_request
from modelship.gateway.service import GatewayService


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # > 4300 digits
        b'{"model": "m", "prompt": "\xff\xfe"}',  # not UTF-8
        b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # too deep
    ],
    ids=["5000-digit-integer", "non-utf8", "nested"],
)
def test_bodies_the_json_decoder_refuses_are_400s(raw: bytes) -> None:
    """json.loads raises a plain ValueError for an integer past Python's digit limit: it
    escaped the handler (which named only JSONDecodeError) and answered 500."""
    with pytest.raises(GatewayError) as info:
        parse_request(raw, "/v1/completions", None, RequestLimitsConfig())
    assert info.value.status_code == 400
    assert "parse the JSON" in info.value.message


@pytest.fixture
def client() -> TestClient:
    config = GatewayConfig()
    service = GatewayService(config, EndpointPool(config.resilience))
    # Not entered as a context manager: no lifespan, no health checks, no replica.
    return TestClient(create_gateway_app(service, health_checks=False))


def test_a_method_a_route_lacks_is_an_openai_405(client: TestClient) -> None:
    """Starlette answered a plain-text "Method Not Allowed"."""
    response = client.get("/v1/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    error = response.json()["error"]
    assert error["code"] == "method_not_allowed"
    assert "GET is not allowed on /v1/completions" in error["message"]


def test_an_unknown_path_is_an_openai_404(client: TestClient) -> None:
    response = client.post("/v1/audio/speech", json={})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_more_prompts_than_the_cap_is_a_400() -> None:
    """The replicas' cap (`max_prompts`), checked before a request is admitted."""
    limits = RequestLimitsConfig(max_prompts=2)
    body = b'{"model": "m", "prompt": ["a", "b", "c"]}'
    with pytest.raises(GatewayError, match="at most 2 prompts") as info:
        parse_request(body, "/v1/completions", None, limits)
    assert info.value.status_code == 400
    ok = b'{"model": "m", "prompt": [[1, 2], [3]]}'
    assert parse_request(ok, "/v1/completions", None, limits).num_sequences == 2


def _chunks(total: int, size: int = 2**16):
    sent = 0
    while sent < total:
        yield b" " * min(size, total - sent)
        sent += size


def test_a_body_over_the_cap_is_an_openai_413_declared_or_chunked() -> None:
    """No size cap: a client could make the gateway buffer (and JSON-parse) any body. Over
    `max_body_mb` it is refused: by its Content-Length before reading, or, chunked, as
    soon as the bytes received pass the cap."""
    config = GatewayConfig(request_limits=RequestLimitsConfig(max_body_mb=1))
    service = GatewayService(config, EndpointPool(config.resilience))
    client = TestClient(create_gateway_app(service, health_checks=False))
    declared = client.post("/v1/completions", content=b" " * (2**20 + 1),
                           headers={"content-type": "application/json"})  # fmt: skip
    chunked = client.post("/v1/completions", content=_chunks(3 * 2**20),
                          headers={"content-type": "application/json"})  # fmt: skip
    for response in (declared, chunked):
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
    small = client.post("/v1/completions", content=b"{" + b" " * 2**19,
                        headers={"content-type": "application/json"})  # fmt: skip
    assert small.status_code == 400  # under the cap: parsed, and refused for what it is


def test_a_prompt_over_max_prompt_tokens_is_a_400_before_its_ids_are_read() -> None:
    """The bound `modelship up` sets from serve.engine.max_model_len: a longer token-id
    prompt (alone or one of several) is refused by its length, items unread."""
    limits = RequestLimitsConfig(max_prompt_tokens=4)
    for prompt in ([0] * 5, [[0], [0] * 5], [0, 0, 0, 0, 0, "not read"]):
        body = json.dumps({"model": "m", "prompt": prompt}).encode()
        with pytest.raises(GatewayError, match="at most 4 token ids") as info:
            parse_request(body, "/v1/completions", None, limits)
        assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    ok = json.dumps({"model": "m", "prompt": [[0] * 4, [1] * 4]}).encode()
    assert parse_request(ok, "/v1/completions", None, limits).input_tokens == 8


def test_up_and_gateway_bound_prompts_by_the_engines_max_model_len() -> None:
    assert GatewayConfig().bounded_by(512).request_limits.max_prompt_tokens == 512
    assert GatewayConfig().bounded_by(None).request_limits.max_prompt_tokens is None
    own = GatewayConfig(request_limits=RequestLimitsConfig(max_prompt_tokens=100))
    assert own.bounded_by(512).request_limits.max_prompt_tokens == 100


def test_a_standalone_gateway_refuses_prompts_past_serve_max_model_len(tmp_path) -> None:
    """`modelship gateway` (Kubernetes) reads serve.engine.max_model_len as `up` does: the
    prompt is refused before routing (here no replica answers at all: it was a 503)."""
    import time

    import httpx

    from gateway_process import GatewayProcess

    sections = {"serve": {"engine": {"max_model_len": 64}}}
    gateway = GatewayProcess(tmp_path, {}, "--endpoint", "http://127.0.0.1:9",
                             sections=sections)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:  # listening (never ready: its one replica is not there)
            try:
                httpx.get(f"{gateway.url}/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, gateway.log_tail()
                time.sleep(0.2)
        body = {"model": "tiny", "prompt": [0] * 65, "max_tokens": 1}
        response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt"
        body["prompt"] = [0] * 64
        assert httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10).status_code == 503
    finally:
        gateway.stop()
