"""A replica's 400 for a field it does not implement (`server/request_fields.py`) reaches the
client through the gateway unchanged, and is never retried on another replica: the request
is the client's fault, and every replica would refuse it the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway_process import GatewayProcess
from modelship.gateway import hash_api_key
from modelship.gateway.config import RequestLimitsConfig
from modelship.gateway.request import GatewayError, parse_request

from server_process import ServerProcess

MODEL = "tiny"
REPLICA_KEY = "sk-replica-test"
METRICS_KEY = "sk-metrics-test"
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path) -> Iterator[list[ServerProcess]]:
    started = [
        ServerProcess(
            tiny_llama_dir,
            "--served-model-name",
            MODEL,
            "--max-model-len",
            "256",
            "--kv-cache-memory-mb",
            "16",
            api_key=REPLICA_KEY,
        )
        for _ in range(2)
    ]
    yield started
    for process in started:
        process.stop()


@pytest.fixture(scope="module")
def gateway(
    replicas: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    config = {"metrics_api_key_sha256": hash_api_key(METRICS_KEY)}
    endpoints = [arg for r in replicas for arg in ("--endpoint", r.url)]
    process = GatewayProcess(
        tmp_path_factory.mktemp("gateway"), config, *endpoints, api_key=REPLICA_KEY
    )
    process.metrics_key = METRICS_KEY
    process.wait_ready(60)
    yield process
    assert process.stop() == 0, process.log_tail()


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "a", "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"tools": [TOOL]}, "tools"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
        ("/v1/chat/completions", {"store": True}, "store"),
        ("/v1/completions", {"suffix": "b"}, "suffix"),
        ("/v1/completions", {"best_of": 2, "stream": True}, "best_of"),
    ],
)
def test_a_replicas_400_reaches_the_client_unchanged_and_unretried(
    replicas: list[ServerProcess], gateway: GatewayProcess, path, fields, param
) -> None:
    body = (COMPLETION if path == "/v1/completions" else CHAT) | fields
    auth = {"authorization": f"Bearer {REPLICA_KEY}"}
    direct = httpx.post(replicas[0].url + path, json=body, headers=auth, timeout=60)
    assert direct.status_code == 400 and direct.json()["error"]["param"] == param, direct.text
    retries = gateway.metric("modelship_gateway_retries_total")
    failures = gateway.metric("modelship_gateway_upstream_failures_total")
    through = httpx.post(gateway.url + path, json=body, headers=auth, timeout=60)
    assert through.status_code == 400
    assert through.json() == direct.json()
    assert gateway.metric("modelship_gateway_retries_total") == retries
    assert gateway.metric("modelship_gateway_upstream_failures_total") == failures


def test_best_of_is_bounded_like_n_and_counts_its_candidates() -> None:
    """Every candidate runs on the replica: each holds an admission slot, like `n`'s."""
    limits = RequestLimitsConfig(max_n=4)
    ok = b'{"model": "m", "prompt": ["a", "b"], "n": 2, "best_of": 3}'
    assert parse_request(ok, "/v1/completions", None, limits).num_sequences == 6
    for best_of in ("5", "1", '"3"'):
        body = b'{"model": "m", "prompt": "a", "n": 2, "best_of": ' + best_of.encode() + b"}"
        with pytest.raises(GatewayError, match="best_of") as info:
            parse_request(body, "/v1/completions", None, limits)
        assert info.value.status_code == 400 and info.value.param == "best_of"
