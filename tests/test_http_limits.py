"""The request-head cap (`modelship.http_limits`) on a real replica and a real gateway,
spoken to over raw sockets: a head past the cap is refused with 431 while it still streams
in; heads under it are served as before."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway_process import GatewayProcess
from modelship.gateway import hash_api_key
from modelship.http_limits import MAX_HEAD_BYTES

from server_process import ServerProcess

MODEL = "tiny"
REPLICA_KEY, TENANT_KEY = "sk-replica-test", "sk-tenant-test"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def replica(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len", "256",
        "--kv-cache-memory-mb", "16", "--api-key", REPLICA_KEY, timeout_s=300,
    )  # fmt: skip
    yield process
    process.stop()


@pytest.fixture(scope="module")
def gateway(replica: ServerProcess, tmp_path_factory: pytest.TempPathFactory):
    tenants = [{"name": name, "api_key_sha256": hash_api_key(f"{TENANT_KEY}-{name}")}
               for name in ("a", "b")]  # fmt: skip
    process = GatewayProcess(tmp_path_factory.mktemp("gateway"), {"tenants": tenants},
                             "--endpoint", replica.url, api_key=REPLICA_KEY)  # fmt: skip
    process.wait_ready(60)
    yield process
    process.stop()


def _servers(replica: ServerProcess, gateway: GatewayProcess) -> dict[str, tuple[str, str]]:
    return {"replica": (replica.url, "/health"), "gateway": (gateway.url, "/v1/models")}


def _address(url: str) -> tuple[str, int]:
    parsed = httpx.URL(url)
    return parsed.host, parsed.port


def _read_all(sock: socket.socket) -> bytes:
    seen = b""
    while chunk := sock.recv(65536):
        seen += chunk
    return seen


@pytest.mark.parametrize("server", ["replica", "gateway"])
def test_a_head_past_the_cap_is_a_431_while_it_streams_in(replica, gateway, server):
    """httptools has no head limit: one 48 MiB header (no Authorization) was held whole,
    +100 MB on the gateway, then answered 401 (the replica's /health: 200). The head here
    never ends: the answer must come while it streams in, with an OpenAI error body."""
    url, path = _servers(replica, gateway)[server]
    with socket.create_connection(_address(url), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\nX-Flood: ".encode())
        try:
            for _ in range(64):  # 4 MiB, the head never terminated
                sock.sendall(b"a" * 2**16)
        except OSError:  # the server closed: its answer is already on the way
            pass
        answer = _read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), answer[:300]
    error = json.loads(body)["error"]
    assert error["code"] == "request_header_fields_too_large"
    assert f"{MAX_HEAD_BYTES // 2**10} KiB" in error["message"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # still serving


@pytest.mark.parametrize("server", ["replica", "gateway"])
def test_heads_under_the_cap_are_served_on_one_connection(replica, gateway, server):
    """A 60 KiB header (h11 refused past 16 KiB) is served; so is the next request on the
    same keep-alive connection, whose head is counted afresh, sent a byte at a time."""
    url, path = _servers(replica, gateway)[server]
    big = b"b" * (60 * 2**10)
    first = f"GET {path} HTTP/1.1\r\nHost: test\r\nX-Big: ".encode() + big + b"\r\n\r\n"
    second = f"GET {path} HTTP/1.1\r\nHost: test\r\nX-Big: ".encode() + big
    second += b"\r\nConnection: close\r\n\r\n"
    with socket.create_connection(_address(url), timeout=10) as sock:
        sock.sendall(first)
        for start in range(0, len(second), 4096):
            sock.sendall(second[start : start + 4096])
        answer = _read_all(sock)
    expected = b"HTTP/1.1 200" if server == "replica" else b"HTTP/1.1 401"  # no key sent
    assert answer.count(expected) == 2, answer[:300]
    assert b"431" not in answer
