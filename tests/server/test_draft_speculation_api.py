"""Draft-model speculation through the API: `serve --speculative-model` with a 1-layer draft
of the same tokenizer; greedy answers (whole and streamed) equal plain decoding's, sampled
ones come back whole, and the spec_decode counters move. Clients: the openai SDK."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from test_speculative_api import MODEL, PROMPT, counter

from server_process import ServerProcess
from tiny_models import make_tiny_llama


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    draft = make_tiny_llama(tmp_path_factory.mktemp("draft") / "model", seed=1,
                            num_hidden_layers=1)  # fmt: skip
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--engine-core", "process",
        "--num-speculative-tokens", "3", "--speculative-model", str(draft),
    )  # fmt: skip
    yield process
    process.kill()
    process.close_log()


def test_draft_model_speculation_keeps_the_answers(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    drafted = "modelship:spec_decode_num_draft_tokens_total"
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    plain = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert counter(server.url, drafted) == 0  # not by default: nobody asked
    spec = {"ignore_eos": True, "speculative": True}
    whole = client.completions.create(**kwargs, extra_body=spec)
    assert whole.choices[0].text == plain.choices[0].text
    assert whole.usage.completion_tokens == 16
    stream = client.completions.create(**kwargs, stream=True, extra_body=spec)
    assert "".join(c.choices[0].text for c in stream if c.choices) == plain.choices[0].text
    after_greedy = counter(server.url, drafted)
    assert after_greedy > 0
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
        temperature=0.8, seed=3, logprobs=True, extra_body=spec,
    )  # fmt: skip
    assert chat.usage.completion_tokens == 12
    assert len(chat.choices[0].logprobs.content) == 12
    assert counter(server.url, drafted) > after_greedy
