"""Tool calling: the forms models call tools in, parsed whole and streamed piece by piece
(every split of the text gives the same content and calls), the history and tools rendered
for templates with and without tool support, and the request checks on a real server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from modelship.server import protocol as p
from modelship.server.tool_calls import (
    CallParser,
    Parsed,
    ToolUse,
    detect_format,
    parse,
    template_messages,
)

from server_process import ServerProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def use(form: str, parallel: bool = True) -> ToolUse:
    return ToolUse([WEATHER], form, parallel)


def streamed(text: str, tool_use: ToolUse, cuts: list[int]) -> Parsed:
    """`text` fed in the pieces `cuts` makes, then flushed: the parts put together."""
    parser, out, at = CallParser(tool_use), Parsed(), 0
    for cut in [*cuts, len(text)]:
        piece = parser.feed(text[at:cut])
        out.content += piece.content
        out.calls += piece.calls
        at = cut
    rest = parser.flush()
    return Parsed(out.content + rest.content, out.calls + rest.calls)


def calls_of(parsed: Parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


HERMES = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo; N"}}'
    "</tool_call>"
)


@pytest.mark.parametrize(
    ("form", "text", "content", "calls"),
    [
        ("hermes", HERMES, "Let me check.\n",
         [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo; N"})]),
        ("generic", 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}',
         "Sure ", [("get_weather", {"city": "Rome"})]),  # the end marker never came
        ("hermes", "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok",
         []),
        ("hermes", "a < b and <tool", "a < b and <tool", []),
        ("llama3_json",
         '{"name": "get_weather", "parameters": {"city": "Lima"}}; '
         '{"name": "get_weather", "parameters": {"city": "a;b"}}',
         "", [("get_weather", {"city": "Lima"}), ("get_weather", {"city": "a;b"})]),
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "X"}}', "",
         [("get_weather", {"city": "X"})]),
        ("llama3_json", "It is sunny {probably}.", "It is sunny {probably}.", []),
        ("llama3_json", "{not a call}", "{not a call}", []),
        ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Kyiv"}}]', "",
         [("get_weather", {"city": "Kyiv"})]),
        ("mistral", '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Bern\\"}"}]', "",
         [("get_weather", {"city": "Bern"})]),
        ("mistral", "[1] is a footnote.", "[1] is a footnote.", []),
    ],
)  # fmt: skip
def test_every_split_of_a_stream_parses_as_the_whole(form, text, content, calls) -> None:
    whole = parse(text, use(form))
    assert (whole.content, calls_of(whole)) == (content, calls)
    for cut in range(len(text) + 1):
        assert calls_of(streamed(text, use(form), [cut])) == calls, cut
        assert streamed(text, use(form), [cut]).content == content, cut
    one_by_one = streamed(text, use(form), list(range(1, len(text))))
    assert (one_by_one.content, calls_of(one_by_one)) == (content, calls)


def test_content_streams_as_it_comes_and_holds_back_only_a_marker_start() -> None:
    parser = CallParser(use("hermes"))
    assert parser.feed("The weather <to").content == "The weather "
    assert parser.feed("day> is fine").content == "<today> is fine"
    assert parser.feed(' <tool_call>{"name": "get_weather", ').content == " "
    piece = parser.feed('"arguments": {"city": "Nice"}}</tool_call>')
    assert calls_of(piece) == [("get_weather", {"city": "Nice"})]


def test_no_parallel_calls_keeps_the_first() -> None:
    parsed = parse(HERMES, use("hermes", parallel=False))
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})]


def test_each_call_gets_its_own_id() -> None:
    ids = [call.id for call in parse(HERMES, use("hermes")).calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_the_format_is_read_from_the_template() -> None:
    assert detect_format("{% for tool in tools %}<tool_call>{% endfor %}") == "hermes"
    assert detect_format("Environment: ipython <|python_tag|>") == "llama3_json"
    assert detect_format("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "generic"


HISTORY = [
    p.ChatMessage(role="user", content="Weather in Paris?"),
    p.ChatMessage(
        role="assistant",
        tool_calls=[
            p.ToolCallOut(
                id="call_1",
                function=p.FunctionCall(name="get_weather", arguments='{"city": "Paris"}'),
            )
        ],
    ),
    p.ChatMessage(role="tool", tool_call_id="call_1", content="18 C, clear"),
]


def test_history_reaches_a_tool_template_as_transformers_passes_it() -> None:
    rendered = template_messages(HISTORY, use("hermes"))
    assert rendered[1]["tool_calls"] == [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]  # fmt: skip
    assert rendered[2] == {"role": "tool", "content": "18 C, clear", "tool_call_id": "call_1"}


def test_a_template_without_tools_gets_them_and_the_history_as_text() -> None:
    rendered = template_messages(HISTORY, use("generic"))
    assert rendered[0]["role"] == "system" and '"name": "get_weather"' in rendered[0]["content"]
    assert "<tool_call>" in rendered[0]["content"]
    assert rendered[2]["content"].startswith("<tool_call>\n")
    assert json.loads(rendered[2]["content"].split("\n")[1]) == {
        "name": "get_weather", "arguments": {"city": "Paris"}
    }  # fmt: skip
    assert rendered[3] == {
        "role": "user",
        "content": "<tool_response>\n18 C, clear\n</tool_response>",
    }


# On a real server --------------------------------------------------------------------------
API_KEY = "sk-test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def client(tiny_llama_dir: Path) -> Iterator[openai.OpenAI]:
    server = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--api-key", API_KEY,
        "--max-model-len", "1024", "--kv-cache-memory-mb", "16",
    )  # fmt: skip
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    server.stop()


def test_a_parser_flag_sets_the_form_the_answer_is_parsed_in(tiny_llama_dir: Path) -> None:
    """With `--tool-call-parser hermes` the tools go to the template (which ignores them:
    no system turn is added), unlike the generic form the tiny template gets by default."""
    server = ServerProcess(
        tiny_llama_dir, "--served-model-name", MODEL, "--max-model-len", "512",
        "--kv-cache-memory-mb", "16", "--tool-call-parser", "hermes",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        question = [{"role": "user", "content": "Weather in Paris?"}]
        plain = client.chat.completions.create(model=MODEL, max_tokens=1, messages=question)
        tooled = client.chat.completions.create(
            model=MODEL, max_tokens=1, messages=question, tools=[WEATHER]
        )
        assert tooled.usage.prompt_tokens == plain.usage.prompt_tokens  # type: ignore[union-attr]
    finally:
        server.stop()


def test_tools_and_tool_history_reach_the_prompt(client: openai.OpenAI) -> None:
    def prompt_tokens(**fields) -> int:
        answer = client.chat.completions.create(model=MODEL, max_tokens=1, **fields)
        return answer.usage.prompt_tokens  # type: ignore[union-attr]

    question = [{"role": "user", "content": "Weather in Paris?"}]
    plain = prompt_tokens(messages=question)
    with_tools = prompt_tokens(messages=question, tools=[WEATHER])
    assert with_tools > plain + 20  # the tool described in a system turn (generic form)
    assert prompt_tokens(messages=question, tools=[WEATHER], tool_choice="none") == plain
    history = [m.model_dump(exclude_none=True) for m in HISTORY]
    assert prompt_tokens(messages=history, tools=[WEATHER]) > with_tools


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
         "tools.0.function.name"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}],
          "tools": [WEATHER]}, "messages.0.tool_calls"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400_naming_the_field(client: openai.OpenAI, fields, param) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/chat/completions", body=body, cast_to=object)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == param, error


PLACES = {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "enum": [0, 1, 2]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
BOUNDED = {
    "type": "function",
    "function": {
        **WEATHER["function"],
        "parameters": {
            "type": "object",
            "properties": {"city": PLACES},
            "required": ["city"],
            "additionalProperties": False,  # else the grammar lets a model add any property
        },
    },
}


def test_a_required_tool_choice_always_gets_a_valid_call(client: openai.OpenAI) -> None:
    """The tiny random model never writes a call by itself: under the grammar that
    `required` builds, every answer is one, with arguments that match the schema."""
    for seed in range(3):
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=120,
            tools=[BOUNDED, TIME], tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=seed,
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls  # type: ignore[misc]
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert arguments["city"] in PLACES["enum"]
        else:
            assert call.function.name == "get_time" and isinstance(arguments["zone"], int)


def test_a_named_tool_choice_calls_that_tool_streamed_as_deltas(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather?"}],
            max_tokens=120,
            tools=[TIME, BOUNDED],
            stream=True,
            temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    [call] = calls
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in PLACES["enum"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_with_a_json_response_format_the_answer_is_calls_or_that_json(client) -> None:
    """A forced call leaves the format no text to shape; with "auto" the answer is either
    calls or the JSON the format asks for (as OpenAI answers such requests)."""
    weather = {"type": "object", "properties": {"city": PLACES}, "required": ["city"],
               "additionalProperties": False}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": weather}}
    forced = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=120,
        tools=[TIME], tool_choice="required", response_format=response_format,
    )  # fmt: skip
    assert forced.choices[0].message.tool_calls[0].function.name == "get_time"  # type: ignore[index]
    kinds = set()
    for seed in range(4):
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=200,
            tools=[TIME], response_format=response_format, temperature=1.0, seed=seed,
        ).choices[0]  # fmt: skip
        assert answer.finish_reason in ("stop", "tool_calls"), answer
        if answer.message.tool_calls:
            kinds.add("call")
            assert json.loads(answer.message.tool_calls[0].function.arguments)["zone"] in (0, 1, 2)
        else:
            kinds.add("json")
            assert json.loads(answer.message.content or "")["city"] in PLACES["enum"]
    assert kinds  # which of the two a random model picks is its own business


def test_responses_with_a_required_tool_answer_a_function_call_item(client) -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": BOUNDED["function"]["parameters"],
    }
    response = client.responses.create(
        model=MODEL, input="Weather?", tools=[tool], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=120,
    )  # fmt: skip
    [item] = response.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments)["city"] in PLACES["enum"]
    assert response.status == "completed"
