"""Structured outputs through a real `modelship serve` and the unmodified openai SDK:
`chat.completions.parse` with a pydantic model, json_object, vLLM's guided_* and
structured_outputs fields, on chat and completions; bad schemas are 400s naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel, Field

from server_process import ServerProcess

MODEL = "tiny"
API_KEY = "sk-structured"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    admin: bool


# strict, as the SDK's parse() sends it: no properties beyond these
PERSON_SCHEMA = {**Person.model_json_schema(), "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tiny_llama_dir,
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "512",
        "--kv-cache-memory-mb",
        "16",
        "--api-key",
        API_KEY,  # resume_token_ids and return_token_ids are the gateway's, trusted by key
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=200, seed=1
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person), choice.message.content


def test_json_object_n2_streamed_and_whole(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=300,
        n=2,
        seed=3,
        # a random model wanders inside strings: bounded keys and values end it sooner
        extra_body={"top_k": 8},
    )
    for choice in response.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": PERSON_SCHEMA},
        },
        max_tokens=200,
        seed=4,
        stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    Person.model_validate_json(text)


def test_guided_choice_and_regex_on_chat_and_completions(client: openai.OpenAI) -> None:
    choices = ["red", "green", "blue"]
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, extra_body={"guided_choice": choices}
    )
    assert chat.choices[0].message.content in choices
    completion = client.completions.create(
        model=MODEL,
        prompt="A date:",
        max_tokens=30,
        temperature=0,
        extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"},
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", completion.choices[0].text)
    vllm = client.completions.create(
        model=MODEL,
        prompt="Pick:",
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert vllm.choices[0].text in ("yes", "no")


def test_max_tokens_too_small_is_length(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": PERSON_SCHEMA},
        },
    )
    assert response.choices[0].finish_reason == "length"
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=4
        )


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
            "uniqueItems",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format",
            "strin",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        (
            {"structured_outputs": {"grammar": "start: 'a' | "}},
            "structured_outputs.grammar",
            "lexer",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(client, extra, param, fragment) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=extra
        )
    error = info.value.body
    assert error["param"] == param and fragment in error["message"], error


def stream_ids(client: openai.OpenAI, **extra) -> tuple[str, list[int], str | None]:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "response_format": {"type": "json_schema",
                    "json_schema": {"name": "p", "schema": PERSON_SCHEMA}}, **extra},
    )  # fmt: skip
    text, ids, finish = "", [], None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            ids += getattr(chunk.choices[0], "token_ids", None) or []
            finish = chunk.choices[0].finish_reason or finish
    return text, ids, finish


def test_a_resumed_stream_continues_inside_the_grammar(client: openai.OpenAI) -> None:
    """What the gateway sends on failover: the same body plus the ids already streamed;
    the replica's matcher starts after them, so the two halves make the whole answer."""
    whole, ids, finish = stream_ids(client)
    assert finish == "stop"
    Person.model_validate_json(whole)
    k = len(ids) // 2
    rest, rest_ids, rest_finish = stream_ids(client, resume_token_ids=ids[:k])
    assert rest_ids == ids[k:] and rest_finish == "stop"
    assert whole.endswith(rest)
