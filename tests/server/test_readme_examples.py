"""The README's Python examples, run as written against a real `modelship serve` of the
tiny random model: the quick start's first request and every block of "Using the API",
in order, in one namespace (the first block makes the `client` the others use). Only the
address changes (the server's free port for :8000), and the quick start's model name
(the fleet serves the demo model under its slug; this replica is `smollm2`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from server_process import ServerProcess

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
pytestmark = pytest.mark.timeout(300)


def python_blocks(heading: str) -> list[str]:
    section = re.search(rf"^## {re.escape(heading)}.*?(?=^## )", README, re.S | re.M)
    assert section, f"README.md has no '## {heading}' section"
    return re.findall(r"```python\n(.*?)```", section.group(0), re.S)


@pytest.fixture(scope="module")
def url(tiny_llama_dir: Path) -> Iterator[str]:
    server = ServerProcess(
        tiny_llama_dir, "--served-model-name", "smollm2", "--max-model-len", "2048",
        "--kv-cache-memory-mb", "32", api_key="sk-local",
    )  # fmt: skip
    yield server.url
    server.stop()


def run_block(block: str, url: str, namespace: dict) -> None:
    code = block.replace("http://127.0.0.1:8000", url)
    where = f"README.md, the block starting {block.splitlines()[0]!r}"
    exec(compile(code, where, "exec"), namespace)  # the README's own code


def test_the_quick_start_request_works(url: str) -> None:
    [block] = python_blocks("Quick start")
    assert 'model="smollm2-135m-instruct"' in block
    block = block.replace('model="smollm2-135m-instruct"', 'model="smollm2"')
    run_block(block.replace('api_key="none"', 'api_key="sk-local"'), url, {})


def test_the_using_the_api_examples_work(url: str) -> None:
    blocks = python_blocks("Using the API")
    assert len(blocks) >= 5  # client, structured output, tool call, embeddings, responses
    namespace: dict = {}
    for block in blocks:
        run_block(block, url, namespace)
    assert namespace["reply"].choices[0].message.tool_calls
    assert namespace["vectors"].data[0].embedding
