"""Speculative decoding through the API: `serve --num-speculative-tokens`, a request's
`"speculative"` field (through the openai SDK's extra_body), streamed and whole answers
equal to plain decoding, and the spec_decode counters on /metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_process import ServerProcess

MODEL = "tiny"
PROMPT = "one two three four five six seven. one two three four five six seven. one two"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path):
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--engine-core", "process",
        "--num-speculative-tokens", "4",
    )  # fmt: skip
    yield process
    process.kill()
    process.close_log()


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not on /metrics")


def test_a_request_that_opts_in_gets_the_same_text_in_fewer_steps(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    accepted = "modelship:spec_decode_num_accepted_tokens_total"
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    plain = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert counter(server.url, accepted) == 0  # not by default: nobody asked
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True,
                                                              "speculative": True})  # fmt: skip
    assert whole.choices[0].text == plain.choices[0].text
    assert whole.usage.completion_tokens == plain.usage.completion_tokens == 32
    after_whole = counter(server.url, accepted)
    assert after_whole > 0
    stream = client.completions.create(
        **kwargs, stream=True, extra_body={"ignore_eos": True, "speculative": True}
    )
    chunks = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(chunks) == plain.choices[0].text
    assert len(chunks) < 32  # accepted drafts arrive together
    assert counter(server.url, accepted) > after_whole
    drafted = counter(server.url, "modelship:spec_decode_num_draft_tokens_total")
    assert drafted >= counter(server.url, accepted)


def test_a_bad_speculative_field_is_a_400(server) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": "hi", "speculative": "very"}, timeout=30)  # fmt: skip
    assert response.status_code == 400
    assert "speculative" in response.json()["error"]["message"]
