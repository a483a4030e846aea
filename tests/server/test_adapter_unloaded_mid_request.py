"""An adapter unloaded while a request for it is already admitted (checked, waiting for its
prompt to be tokenized) is a 404 like any model not served, never a 500: a gateway counts
a 5xx against the replica and retries it, so a few of these would open every breaker.

The window is made wide on purpose: two multi-megabyte prompts hold the replica's one
tokenizing thread for seconds, the adapter's request is checked and queues behind them,
and the adapter is unloaded before its turn comes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_process import ServerProcess
from tiny_models import make_tiny_lora

MODEL = "tiny"
HUGE = "hello world " * 350_000  # 4.2 MB: seconds of tokenizing
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("adapter")
    return make_tiny_lora(tiny_llama_dir, folder / "extra", 4, ["q_proj"], seed=3)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, adapter: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len", "256",
        "--kv-cache-memory-mb", "16", "--lora", f"extra={adapter}", "--enable-lora-admin",
        timeout_s=300,
    )  # fmt: skip
    yield process
    process.stop()


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_an_adapter_unloaded_under_an_admitted_request_is_a_404(
    server: ServerProcess, adapter: Path
) -> None:
    statuses = []
    with ThreadPoolExecutor(3) as pool:
        for _ in range(3):  # the window is timing; one hit shows the mapping
            if statuses and statuses[-1] == 404:
                break
            busy = [
                pool.submit(post, server, "/v1/completions",
                            {"model": MODEL, "prompt": HUGE, "max_tokens": 1})
                for _ in range(2)
            ]  # fmt: skip
            time.sleep(0.5)
            waiting = pool.submit(
                post, server, "/v1/completions", {"model": "extra", "prompt": "hi", "max_tokens": 2}
            )
            time.sleep(1.0)
            unloaded = post(server, "/v1/unload_lora_adapter", {"lora_name": "extra"})
            assert unloaded.status_code == 200, unloaded.text
            answer = waiting.result()
            statuses.append(answer.status_code)
            assert answer.status_code in (200, 404), answer.text  # never a 500
            if answer.status_code == 404:
                error = answer.json()["error"]
                assert error["code"] == "model_not_found" and error["param"] == "model"
            for request in busy:
                assert request.result().status_code == 400  # over the context: the client's
            loaded = post(server, "/v1/load_lora_adapter",
                          {"lora_name": "extra", "lora_path": str(adapter)})  # fmt: skip
            assert loaded.status_code == 200, loaded.text
    assert 404 in statuses, statuses
