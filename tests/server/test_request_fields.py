"""Every field of OpenAI's request spec is implemented or refused with a 400 naming it
(`server/request_fields.py`), driven by the official `openai` SDK against `modelship serve`:
refused fields, harmless ones, `logit_bias`, `best_of` and `suffix`."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from modelship.engine.tokenizer import Tokenizer
from modelship.server import protocol as p
from modelship.server import request_fields as f

from server_process import ServerProcess
from tiny_models import make_tiny_llama

API_KEY = "sk-test-key"
MODEL = "tiny"
MAX_N = 4
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len", "256",
        "--kv-cache-memory-mb", "16", "--max-n", str(MAX_N), api_key=API_KEY,
    )  # fmt: skip
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def token_text(tiny_llama_dir: Path) -> dict[int, str]:
    tokenizer = Tokenizer.from_folder(tiny_llama_dir)
    return {i: tokenizer.decode([i]) for i in range(len(tokenizer))}


def chat(client: openai.OpenAI, **fields):
    fields.setdefault("max_tokens", 2)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], **fields
    )


def refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    error = caught.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_every_spec_field_is_in_exactly_one_list() -> None:
    """Fails when the openai SDK adds a field: decide it in `request_fields.py`."""
    sdk_chat = set(chat_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    sdk_completion = set(completion_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert sdk_chat == f.CHAT_SPEC_FIELDS
    assert sdk_completion == f.COMPLETION_SPEC_FIELDS
    lists = [f.IMPLEMENTED, set(f.ACCEPTED), set(f.REFUSED), f.ELSEWHERE]
    for name in f.CHAT_SPEC_FIELDS | f.COMPLETION_SPEC_FIELDS:
        assert sum(name in group for group in lists) == 1, name
    # declared on the request models, so a client's value is seen and not dropped
    declared = set(p.ChatCompletionRequest.model_fields) | set(p.CompletionRequest.model_fields)
    assert declared >= (f.CHAT_SPEC_FIELDS | f.COMPLETION_SPEC_FIELDS) - f.ELSEWHERE
    assert declared >= f.VLLM_EXTRAS | f.MODELSHIP_EXTRAS


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"store": True}, "store"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"verbosity": "low"}, "verbosity"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"extra_body": {"moderation": {"model": "x"}}}, "moderation"),
    ],
)
def test_refused_chat_fields_are_400s_naming_them(client, fields, param) -> None:
    error = refused(lambda: chat(client, **fields))
    assert error["param"] == param
    assert error["message"].startswith(f"{param} is not supported by this server")
    assert error["type"] == "invalid_request_error"


def test_a_deprecated_function_call_in_the_history_is_refused(client) -> None:
    """Tool calls in the history are served (tests/server/test_tool_calls.py); the
    deprecated functions API's are not."""
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
    ]
    error = refused(
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    )
    assert error["param"] == "messages.1.function_call"
    assert "use tools and tool_choice" in error["message"]


def test_fields_that_ask_for_nothing_are_accepted(client) -> None:
    reply = chat(
        client, tools=[], tool_choice="auto", parallel_tool_calls=False, store=False,
        metadata={"k": "v"}, user="u1", safety_identifier="s1", service_tier="auto",
        modalities=["text"], prompt_cache_key="k", seed=3,
        prediction={"type": "content", "content": "hello"},
        extra_body={"top_k": 5, "not_in_any_spec": 1},
    )  # fmt: skip
    assert reply.choices[0].message.content is not None
    # no `<think>` in this model's template: no reasoning fields
    assert not reply.choices[0].message.model_extra


def test_logit_bias_forces_and_bans_tokens(client, token_text) -> None:
    forced = next(i for i, t in token_text.items() if i > 50 and t.isascii() and t.isalpha())
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=4, logprobs=1)
    greedy = client.completions.create(**kwargs, temperature=0, logit_bias={str(forced): 100})
    assert greedy.choices[0].logprobs.tokens == [token_text[forced]] * 4
    assert all(lp > -1e-3 for lp in greedy.choices[0].logprobs.token_logprobs)  # biased dist
    sampled = client.completions.create(
        **kwargs, temperature=1.0, n=3, logit_bias={str(forced): 100}
    )
    assert [c.text for c in sampled.choices] == [token_text[forced] * 4] * 3

    plain = client.completions.create(**kwargs, temperature=0)
    first = plain.choices[0].logprobs.tokens[0]
    first_ids = [i for i, t in token_text.items() if t == first]
    banned = client.completions.create(
        **kwargs, temperature=0, logit_bias={str(i): -100 for i in first_ids}
    )
    assert banned.choices[0].logprobs.tokens[0] != first

    chat_reply = chat(client, temperature=0, max_tokens=3, logit_bias={str(forced): 100})
    assert chat_reply.choices[0].message.content == token_text[forced] * 3


@pytest.mark.parametrize(
    ("bias", "fragment"),
    [
        ({str(i): 1 for i in range(301)}, "at most 300"),
        ({"5": 101}, "[-100, 100]"),
        ({"5": -100.5}, "[-100, 100]"),
        ({"abc": 1}, "'abc' is not a token id"),
        ({"-1": 1}, "'-1' is not a token id"),
        ({"100000": 1}, "'100000' is not a token id"),
        ({"9" * 5000: 1}, "is not a token id"),  # past int()'s digit limit
    ],
)
def test_bad_logit_bias_is_a_400_naming_it(client, bias, fragment) -> None:
    error = refused(lambda: chat(client, logit_bias=bias))
    assert error["param"] == "logit_bias" and fragment in error["message"], error


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(client) -> None:
    kwargs = dict(model=MODEL, prompt="The quick", max_tokens=6, temperature=1.0, seed=7)
    # siblings are seeded seed + index: n=4 generates best_of=4's candidates
    everything = client.completions.create(**kwargs, n=4, logprobs=0)
    best = client.completions.create(**kwargs, n=2, best_of=4)

    def score(choice) -> float:
        return math.fsum(choice.logprobs.token_logprobs)

    ranked = sorted(everything.choices, key=score, reverse=True)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # not asked for
    assert best.usage.completion_tokens == everything.usage.completion_tokens


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"n": 2, "best_of": 1}, "at least n"),
        ({"best_of": MAX_N + 1}, f"at most {MAX_N}"),
        ({"best_of": 2, "stream": True}, "stream"),
    ],
)
def test_bad_best_of_is_a_400_naming_it(client, fields, fragment) -> None:
    error = refused(
        lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **fields)
    )
    assert error["param"] == "best_of" and fragment in error["message"], error


def test_suffix_without_fim_tokens_is_a_400(client) -> None:
    error = refused(
        lambda: client.completions.create(model=MODEL, prompt="a", suffix="b", max_tokens=2)
    )
    assert error["param"] == "suffix" and "fill-in-the-middle" in error["message"]


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A tiny model whose vocabulary has StarCoder's FIM tokens (ids past the trained ones,
    inside the model's embedding)."""
    from transformers import AutoTokenizer

    folder = make_tiny_llama(tmp_path_factory.mktemp("fim") / "model", vocab_size=336)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]}
    )
    tokenizer.save_pretrained(folder)
    process = ServerProcess(
        folder, "--served-model-name", MODEL, "--max-model-len", "256",
        "--kv-cache-memory-mb", "16",
    )  # fmt: skip
    yield process
    process.stop()


def test_suffix_builds_the_fill_in_the_middle_prompt(fim_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{fim_server.url}/v1", api_key="none", max_retries=0)
    tokenizer = Tokenizer.from_folder(fim_server.model_dir)
    fim_ids = [tokenizer.convert_tokens_to_ids(t)
               for t in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")]  # fmt: skip
    prefix, suffix = "def add(a, b):", "    return c"
    prefix_ids = tokenizer.encode(prefix, add_special_tokens=False)
    suffix_ids = tokenizer.encode(suffix, add_special_tokens=False)
    ids = [fim_ids[0], *prefix_ids, fim_ids[1], *suffix_ids, fim_ids[2]]
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0)
    infilled = client.completions.create(prompt=prefix, suffix=suffix, **kwargs)
    by_ids = client.completions.create(prompt=ids, **kwargs)
    assert infilled.usage.prompt_tokens == len(ids)
    assert infilled.choices[0].text == by_ids.choices[0].text
