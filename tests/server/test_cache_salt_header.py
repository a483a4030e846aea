"""A replica without an API key ignores the cache-namespace header: anyone could send it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_process import ServerProcess

PROMPT = "Prefix caching reuses the key and value blocks of a prompt seen before. " * 3

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "256",
        "--kv-cache-memory-mb", "16",
    )  # fmt: skip
    yield process
    process.stop()


def hits_with_salt(server: ServerProcess, salt: str) -> float:
    def hits() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "modelship:prefix_cache_hits_total"
        )

    before = hits()
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2},
        headers={"x-modelship-cache-salt": salt},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return hits() - before


def test_without_an_api_key_the_header_is_ignored(server: ServerProcess) -> None:
    assert hits_with_salt(server, "tenant-a") == 0
    # Had the header counted, another namespace would miss; ignored, it hits.
    assert hits_with_salt(server, "tenant-b") >= 6 * 16
