"""Token-id lists bounded before they are validated (`server/token_limit.py` on a replica,
`gateway.request_limits.max_prompt_tokens` at a gateway), on real processes. A completion
of 4 million token ids (7.6 MiB, under the body cap) held a replica's event loop for
seconds in pydantic before its length check; at the cap the stall outlasted two health
checks and the gateway sent the same body on to the next replica."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway_process import GatewayProcess
from modelship.gateway import hash_api_key

from server_process import ServerProcess

MODEL = "tiny"
MAX_MODEL_LEN = 256
KEY = "sk-tenant-test"
REPLICA_KEY = "sk-replica-test"
METRICS_KEY = "sk-metrics-test"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def replica(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-mb", "16", timeout_s=300,
    )  # fmt: skip
    yield process
    process.stop()


def _flood(num_ids: int) -> bytes:
    """A completion of `num_ids` zeros, written as a client would (no spaces)."""
    ids = ",".join(["0"] * num_ids)
    return f'{{"model": "{MODEL}", "max_tokens": 1, "prompt": [{ids}]}}'.encode()


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(f"{url}/v1/completions", content=body, headers=headers, timeout=120)


def test_a_replica_refuses_4_million_token_ids_before_validating_them(replica):
    """The answer used to be the engine's context-length 400 (param max_tokens), reached
    only after pydantic had validated every id: now the prompt's length, found on the raw
    body, is the 400."""
    response = _post(replica.url, _flood(4_000_000))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert f"at most {MAX_MODEL_LEN} token ids" in error["message"]
    assert httpx.get(f"{replica.url}/ready", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": [[0] * (MAX_MODEL_LEN + 1), [0]]}, "prompt", "token ids"),
        ({"prompt": [[0]] * 300}, "prompt", "at most 64 prompts"),
        ({"prompt": [0], "stop_token_ids": [1] * 300}, "stop_token_ids", "at most 16 ids"),
        ({"prompt": [0], "stream": True, "resume_token_ids": [1] * 300}, "resume_token_ids",
         f"at most {MAX_MODEL_LEN} token ids"),
    ],
    ids=["one-of-two-prompts", "prompts", "stop-ids", "resume-ids"],
)  # fmt: skip
def test_each_long_list_is_a_400_naming_its_field(replica, body, param, message):
    response = _post(replica.url, json.dumps({"model": MODEL, **body}).encode())
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize(("path", "field"), [("/v1/chat/completions", "messages"),
                                             ("/v1/responses", "input")])  # fmt: skip
def test_a_million_chat_messages_are_a_400_before_they_are_validated(replica, path, field):
    """Each `{}` was a pydantic validation (and an error entry) before any length check;
    a Responses request's `input` items are messages the same way."""
    messages = ",".join(["{}"] * 1_000_000)
    body = f'{{"model": "{MODEL}", "max_tokens": 1, "{field}": [{messages}]}}'.encode()
    response = httpx.post(f"{replica.url}{path}", content=body, timeout=120,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and f"at most {MAX_MODEL_LEN} messages" in error["message"]
    assert httpx.get(f"{replica.url}/ready", timeout=10).status_code == 200


def test_prompts_within_the_bounds_are_served(replica):
    """A body with many commas takes the slow path (parsed, counted) and goes on."""
    prompts = [[0] * (MAX_MODEL_LEN - 2)] * 2
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "stop": [", ,"]}
    response = _post(replica.url, json.dumps(body).encode())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 2 * (MAX_MODEL_LEN - 2)


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A gateway with a tenant, in front of a replica of its own: tenants need the
    replicas' key (they trust the gateway's per-tenant settings from its holders only)."""
    replica = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-mb", "16", timeout_s=300, api_key=REPLICA_KEY,
    )  # fmt: skip
    config = {
        "tenants": [{"name": "a", "api_key_sha256": hash_api_key(KEY)}],
        "request_limits": {"max_prompt_tokens": MAX_MODEL_LEN},
        "metrics_api_key_sha256": [hash_api_key(METRICS_KEY)],
    }
    process = GatewayProcess(tmp_path_factory.mktemp("gateway"), config, "--endpoint",
                             replica.url, api_key=REPLICA_KEY)  # fmt: skip
    process.metrics_key = METRICS_KEY  # the retries series moves per request
    try:
        process.wait_ready(60)
        yield process
    finally:
        process.stop()
        replica.stop()


def test_a_gateway_refuses_a_prompt_over_its_bound_before_routing(gateway):
    """Without the bound, the gateway parsed and priced every id, then routed the body; a
    replica stalled by it was taken for dead and the body retried on the next."""
    auth = {"authorization": f"Bearer {KEY}"}
    response = _post(gateway.url, _flood(4_000_000), auth)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "x-modelship-release" not in response.headers  # no replica answered it
    ok = _post(gateway.url, _flood(MAX_MODEL_LEN - 1), auth)
    assert ok.status_code == 200, ok.text
    assert gateway.metric("modelship_gateway_retries_total") == 0
