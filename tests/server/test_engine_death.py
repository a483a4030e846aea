"""A replica whose engine thread dies: open requests fail, /ready and /health turn 503.

The server runs in this process (uvicorn on 127.0.0.1 in a thread) so that the test can
make one engine step raise; nothing in the shipped API can do that.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from modelship.engine import AsyncLLMEngine, EngineConfig, LLMEngine
from modelship.server.app import create_app

MODEL = "tiny"


@pytest.fixture
def replica(tiny_llama_dir: Path) -> Iterator[tuple[str, AsyncLLMEngine]]:
    engine = AsyncLLMEngine(LLMEngine(tiny_llama_dir, EngineConfig(num_kv_blocks=64)))
    app = create_app(engine, MODEL)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    try:
        yield url, engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def test_dead_engine_thread_fails_open_requests_and_turns_the_replica_unhealthy(
    replica: tuple[str, AsyncLLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, engine = replica
    assert httpx.get(f"{url}/ready").status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200

    entered, release = threading.Event(), threading.Event()

    def failing_step():
        entered.set()
        release.wait(30)
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(engine.engine, "step", failing_step)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 20}
    answers: list[httpx.Response] = []

    def post() -> None:
        answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))

    open_request = threading.Thread(target=post)
    open_request.start()
    assert entered.wait(30)  # the request is in the engine, its step is running
    release.set()
    open_request.join(60)

    (answer,) = answers
    assert answer.status_code == 503, answer.text
    assert "engine stopped" in answer.json()["error"]["message"]
    ready = httpx.get(f"{url}/ready")
    assert ready.status_code == 503 and ready.json()["status"] == "dead"
    assert httpx.get(f"{url}/health").status_code == 503
    later = httpx.post(f"{url}/v1/completions", json=body, timeout=10)  # refused at once
    assert later.status_code == 503
    assert set(later.json()["error"]) == {"message", "type", "param", "code"}
