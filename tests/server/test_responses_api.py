"""`POST /v1/responses` on a real `modelship serve`, driven by the `openai` SDK's
`client.responses`: the same answer as the chat completion it translates to, the Responses
event sequence when streamed, and a 400 naming each spec field it does not implement."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from modelship import responses_api

from server_process import ServerProcess

API_KEY = "sk-test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tiny_llama_dir,
        "--served-model-name",
        MODEL,
        "--api-key",
        API_KEY,
        "--max-model-len",
        "1024",
        "--kv-cache-memory-mb",
        "16",
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,  # type: ignore[arg-type]
    )
    return answer.choices[0].message.content or "", answer.usage.prompt_tokens  # type: ignore[union-attr]


def test_a_response_is_the_chat_completion_it_translates_to(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="Name a color.",
        max_output_tokens=12,
        temperature=0,
        metadata={"ticket": "42"},
    )
    text, prompt_tokens = chat_text(
        client,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
        12,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == text
    assert response.usage is not None and response.usage.input_tokens == prompt_tokens
    assert response.usage.output_tokens <= 12
    assert response.metadata == {"ticket": "42"}
    assert response.status in ("completed", "incomplete")


def test_items_with_roles_and_text_parts_become_chat_messages(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Answer in one word."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Hi "},
                    {"type": "input_text", "text": "there"},
                ],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "user", "content": "Again?"},
        ],
        max_output_tokens=8,
        temperature=0,
    )
    text, _ = chat_text(
        client,
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again?"},
        ],
        8,
    )
    assert response.output_text == text


def test_a_response_cut_at_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Tell me a long story.", max_output_tokens=2, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 2


def test_a_streamed_response_sends_the_responses_event_sequence(client: openai.OpenAI) -> None:
    whole = client.responses.create(
        model=MODEL, input="Count to five.", max_output_tokens=10, temperature=0
    )
    events = list(
        client.responses.create(
            model=MODEL, input="Count to five.", max_output_tokens=10, temperature=0, stream=True
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    closing = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-1] == closing
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == whole.output_text == final.output_text
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        (
            {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "mcp"}},
            "tool_choice",
        ),
        ({"truncation": "auto"}, "truncation"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"input": []}, "input"),
    ],
)
def test_what_is_not_implemented_is_a_400_naming_the_field(
    client: openai.OpenAI, fields: dict, param: str
) -> None:
    body = {"model": MODEL, "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/responses", body=body, cast_to=object)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert error["message"].startswith(param)


def test_function_tools_and_call_history_reach_the_prompt(client: openai.OpenAI) -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    question = [{"role": "user", "content": "Weather in Paris?"}]

    def input_tokens(**fields) -> int:
        response = client.responses.create(model=MODEL, max_output_tokens=1, **fields)
        return response.usage.input_tokens  # type: ignore[union-attr]

    plain = input_tokens(input=question)
    with_tools = input_tokens(input=question, tools=[tool])
    assert with_tools > plain + 10
    history = [
        *question,
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
    ]
    assert input_tokens(input=history, tools=[tool]) > with_tools


def test_tool_calls_stream_as_function_call_items() -> None:
    request = responses_api.translate_request({"model": "m", "input": "hi", "stream": True})
    events = responses_api.ResponseEvents(request)
    kinds = [e["type"] for e in events.start()]
    call = {
        "index": 0,
        "id": "call_9",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    fed = events.feed({"choices": [{"index": 0, "delta": {"content": "Checking."}}]})
    fed += events.feed({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    fed += events.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    fed += events.finish()
    kinds += [e["type"] for e in fed]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = fed[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["call_id"] == "call_9"
    assert final["output"][1]["arguments"] == '{"city": "Oslo"}'
    assert [e["output_index"] for e in fed if e["type"] == "response.output_item.done"] == [0, 1]


def test_a_chat_stream_error_becomes_error_and_response_failed() -> None:
    request = responses_api.translate_request({"model": "m", "input": "hi", "stream": True})
    events = responses_api.ResponseEvents(request)
    events.start()
    events.feed({"choices": [{"index": 0, "delta": {"content": "He"}}]})
    failed = events.feed({"error": {"message": "engine died", "code": None, "param": None}})
    assert [e["type"] for e in failed] == ["error", "response.failed"]
    assert failed[1]["response"]["status"] == "failed"
    assert failed[1]["response"]["error"]["message"] == "engine died"
    assert events.finish() == []  # nothing after the failure
