"""A reasoning model's `<think>` as `reasoning_content` (and `reasoning`), whole and streamed,
through the openai SDK against `modelship serve`: a tiny model whose chat template opens a
`<think>` block for the answer (Qwen3's and R1's way), found by `--reasoning-parser auto`."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from server_process import ServerProcess
from tiny_models import CHAT_TEMPLATE, make_tiny_llama

MODEL = "thinker"
API_KEY = "sk-test-key"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from transformers import AutoTokenizer

    folder = make_tiny_llama(tmp_path_factory.mktemp("thinker") / "model", vocab_size=336)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<think>", "</think>"])  # plain text tokens, as in Qwen3
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n"
    )
    assert "<think>" in tokenizer.chat_template
    tokenizer.save_pretrained(folder)
    process = ServerProcess(
        folder, "--served-model-name", MODEL, "--max-model-len", "256",
        "--kv-cache-memory-mb", "16", api_key=API_KEY,  # a key: it trusts resume_token_ids
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{process.url}/v1", api_key=API_KEY, max_retries=0)
    client.end_think_id = tokenizer.convert_tokens_to_ids("</think>")  # type: ignore[attr-defined]
    client.encode = tokenizer.encode  # type: ignore[attr-defined]
    yield client
    process.stop()


def thinking(message_or_delta) -> str:
    return (message_or_delta.model_extra or {}).get("reasoning_content") or ""


KWARGS = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0)


def test_an_unclosed_think_is_reasoning_whole_and_streamed(client) -> None:
    # the random model emits `</think>` now and then: banned, the block never closes
    kwargs = KWARGS | {"max_tokens": 12, "logit_bias": {str(client.end_think_id): -100}}
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.model_extra["reasoning"] == reasoning
    assert message.content == ""

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == reasoning
    assert all(d.content in (None, "") for d in deltas)
    assert all((d.model_extra or {}).get("reasoning") == (d.model_extra or {}).get(
        "reasoning_content") for d in deltas)  # fmt: skip


def test_the_answer_after_the_closing_tag_is_content(client) -> None:
    # `</think>` forced at every step: the first closes the block, the rest is the answer
    bias = {str(client.end_think_id): 100}
    whole = client.chat.completions.create(**KWARGS, max_tokens=3, logit_bias=bias)
    message = whole.choices[0].message
    assert message.content == "</think></think>"
    assert "reasoning_content" not in (message.model_extra or {})  # no reasoning: left out
    chunks = client.chat.completions.create(**KWARGS, max_tokens=3, logit_bias=bias, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content


def test_stream_and_whole_response_split_the_same(client) -> None:
    """Unbiased, the random model closes the block somewhere (or not): either way the
    streamed pieces add up to the whole response's two fields."""
    for n in (1, 2):
        kwargs = KWARGS | {"max_tokens": 24, "n": n, "temperature": 1.0, "seed": 5}
        whole = client.chat.completions.create(**kwargs)
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        for choice in whole.choices:
            deltas = [c.choices[0].delta for c in chunks
                      if c.choices and c.choices[0].index == choice.index]  # fmt: skip
            assert "".join(thinking(d) for d in deltas) == thinking(choice.message)
            assert "".join(d.content or "" for d in deltas) == choice.message.content


def test_a_resumed_stream_goes_on_in_the_state_the_failed_one_left(client) -> None:
    """The gateway's failover resumes a stream with the ids already sent: after a
    `</think>` among them, the continuation is content, not reasoning."""
    sent = client.encode("so</think>", add_special_tokens=False)
    assert client.end_think_id in sent
    bias = {str(client.end_think_id): -100}
    chunks = client.chat.completions.create(
        **KWARGS, max_tokens=len(sent) + 6, logit_bias=bias, stream=True,
        extra_body={"resume_token_ids": sent},
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas)
    assert not any(thinking(d) for d in deltas)
