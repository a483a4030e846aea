"""Streams nobody reads must not starve an ordinary request. The fuzz drill's silent readers
(3 streams of n=16, ignore_eos, no max_tokens) on the demo model's 22-block KV cache kept a
2-token completion waiting behind all 48 of their sequences, most of them preempted: no
answer within minutes. Here the tiny model on a 1 MiB cache (2048 tokens, four of the 48
sequences at their full 512) is starved the same way."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_process import ServerProcess

MODEL = "tiny"
NUM_READERS, N = 3, 16


@pytest.fixture
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len",
                            "512", "--kv-cache-memory-mb", "1")  # fmt: skip
    yield process
    process.stop()


def metrics(server: ServerProcess, *names: str) -> float:
    """The sum of `names` from one scrape (two scrapes could see one sequence twice)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name in names)  # fmt: skip


def silent_stream(server: ServerProcess, body: dict) -> socket.socket:
    """A stream request on a socket that is never read (a 4 KiB receive window)."""
    raw = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n")  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((server.host, server.port))
    sock.sendall(head.encode() + raw)
    return sock


def test_an_ordinary_request_is_answered_beside_streams_nobody_reads(
    server: ServerProcess,
) -> None:
    # No max_tokens: each of the 48 sequences may run to the context length.
    abusive = {"model": MODEL, "prompt": "never read", "stream": True, "n": N,
               "ignore_eos": True}  # fmt: skip
    sockets = [silent_stream(server, abusive) for _ in range(NUM_READERS)]
    try:
        deadline = time.monotonic() + 60
        while metrics(server, "modelship:num_preemptions_total") == 0:  # the cache is full
            assert time.monotonic() < deadline, "the silent streams never filled the KV cache"
            time.sleep(0.1)
        ordinary = {"model": MODEL, "prompt": "still there?", "max_tokens": 2}
        response = httpx.post(f"{server.url}/v1/completions", json=ordinary, timeout=120)
        in_engine = metrics(
            server, "modelship:num_requests_running", "modelship:num_requests_waiting"
        )
    finally:
        for sock in sockets:
            sock.close()
    assert response.status_code == 200, response.text
    # Answered while most of the silent sequences still run or wait (all 48 in three runs);
    # queued behind them by arrival alone, it came after 29 to 38 of them had finished.
    assert in_engine >= 2 * NUM_READERS * N / 3
