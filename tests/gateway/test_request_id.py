"""`x-request-id` at a real gateway in front of a real replica, from `http.client` on one
keep-alive connection: a client's valid id is kept, any other replaced (a non-ASCII one
made the gateway answer 500 and reset the connection)."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway_process import GatewayProcess
from modelship.gateway import hash_api_key

from server_process import ServerProcess

MODEL = "tiny"
KEY = "sk-tenant-test"
REPLICA_KEY = "sk-replica-test"  # a gateway with tenants needs the replicas' key
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    replica = ServerProcess(tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len",
                            "256", "--kv-cache-memory-mb", "16", timeout_s=300,
                            api_key=REPLICA_KEY)  # fmt: skip
    tenants = [{"name": name, "api_key_sha256": hash_api_key(f"{KEY}-{name}")}
               for name in ("a", "b")]  # fmt: skip
    process = GatewayProcess(tmp_path_factory.mktemp("gateway"), {"tenants": tenants},
                             "--endpoint", replica.url, api_key=REPLICA_KEY)  # fmt: skip
    try:
        process.wait_ready(60)
        yield process.url
    finally:
        process.stop()
        replica.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_request_ids_kept_when_valid_else_replaced_on_one_connection(gateway: str, stream):
    url = httpx.URL(gateway)
    connection = http.client.HTTPConnection(url.host, url.port, timeout=60)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream})
    sent = [
        "\u00e9t\u00e9".encode(),  # UTF-8 bytes: not ASCII
        b"abc-1.2:3_X",  # valid: kept
        b"a" * 129,  # too long
        b"a b",  # a space
        b"",  # empty
    ]
    try:
        for request_id in sent:
            connection.putrequest("POST", "/v1/completions")
            for name, value in [("authorization", f"Bearer {KEY}-a"),
                                ("content-type", "application/json"),
                                ("content-length", str(len(body))),
                                ("x-request-id", request_id)]:  # fmt: skip
                connection.putheader(name, value)
            connection.endheaders(body.encode())
            response = connection.getresponse()
            content = response.read()
            assert response.status == 200, (request_id, content[:300])
            answered = response.getheader("x-request-id")
            if request_id == b"abc-1.2:3_X":
                assert answered == "abc-1.2:3_X"
            else:
                assert re.fullmatch(r"[0-9a-f]{32}", answered), answered
    finally:
        connection.close()
