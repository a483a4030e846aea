"""The engine core in its own process: its death fails the open requests and ends the
server; the server's death ends the core."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import openai
import pytest

from server_process import ServerProcess

MODEL = "tiny"


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def server(tiny_llama_dir: Path):
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--engine-core", "process"
    )
    yield process
    process.kill()
    process.close_log()


def test_a_killed_core_fails_every_open_stream_and_the_server_exits_1(server) -> None:
    (core,) = children(server.pid)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    started = threading.Barrier(4)
    outcomes: list[object] = []

    def stream(i: int) -> None:
        chunks = 0
        try:
            for _ in client.completions.create(
                model=MODEL,
                prompt=f"stream {i}",
                max_tokens=200,
                stream=True,
                extra_body={"ignore_eos": True},
                timeout=60,
            ):
                chunks += 1
                if chunks == 1:
                    started.wait(timeout=30)
            outcomes.append(f"finished after {chunks} chunks")
        except openai.APIError as exc:
            outcomes.append(exc)

    workers = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for worker in workers:
        worker.start()
    started.wait(timeout=30)  # every stream has a first token
    os.kill(core, 9)
    for worker in workers:
        worker.join(timeout=60)
    assert not any(worker.is_alive() for worker in workers), "a stream hangs"
    assert len(outcomes) == 3
    for outcome in outcomes:
        assert isinstance(outcome, openai.APIError), outcome
        assert "engine" in str(outcome)
    assert server.process.wait(timeout=30) == 1
    assert "the engine core died" in server.log()


def test_a_request_after_the_core_died_gets_503_not_a_hang(server) -> None:
    (core,) = children(server.pid)
    os.kill(core, 9)
    assert wait_until(lambda: not alive(core), 10)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    try:
        client.completions.create(model=MODEL, prompt="late", max_tokens=4, timeout=30)
    except openai.APIStatusError as exc:
        assert exc.status_code == 503
    except openai.APIConnectionError:
        pass  # the server exited already: also no hang
    else:
        pytest.fail("a request after the core's death was served")
    assert server.process.wait(timeout=30) == 1


def test_a_killed_server_takes_its_core_with_it(server) -> None:
    (core,) = children(server.pid)
    server.process.kill()
    server.process.wait(timeout=10)
    assert wait_until(lambda: not alive(core), 30), "the core outlived its server"


def test_a_killed_server_takes_its_core_with_it_even_mid_step(tiny_llama_dir: Path) -> None:
    """A core stuck in a step never reads its pipe's end: it is killed with the server
    anyway, not left an orphan holding the model."""
    from modelship.engine.faults import FAULTS_ENV

    wedge = 7
    os.environ[FAULTS_ENV] = f"wedge={wedge}"
    try:
        server = ServerProcess(tiny_llama_dir, "--served-model-name", MODEL, "--engine-core",
                               "process", "--stall-timeout", "600")  # fmt: skip
    finally:
        del os.environ[FAULTS_ENV]
    try:
        (core,) = children(server.pid)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               timeout=5)  # fmt: skip
        with pytest.raises(openai.APITimeoutError):  # the step holding it never ends
            client.completions.create(model=MODEL, prompt=[1, wedge], max_tokens=4)
        server.process.kill()
        server.process.wait(timeout=10)
        assert wait_until(lambda: not alive(core), 30), "the wedged core outlived its server"
    finally:
        server.kill()
        server.close_log()
