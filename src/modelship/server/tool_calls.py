"""Tool calling: tools and tool-call history into the prompt, calls out of the answer.

A model calls tools in its family's own text form, which its chat template teaches it:
- `hermes` (Qwen 2.5/3, Hermes, most recent templates): `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`, one block per call;
- `llama3_json` (Llama 3.x): the whole answer is `{"name": ..., "parameters": {...}}`
  (several joined by `;`), after `<|python_tag|>` when the tokenizer keeps it;
- `mistral`: `[TOOL_CALLS]` then a JSON list of calls (the marker is often a special token
  the detokenizer drops; a leading JSON list of calls counts the same);
- `generic`, for templates that know nothing of tools: the tools are described in a system
  message this module writes, and the answer uses the `hermes` form it asks for. History
  turns are rendered as text the same way (a call as its `<tool_call>` block, a tool's
  result as a user turn in `<tool_response>`).
The format is read from the template's source (`detect_format`). Parsing works on the
whole answer or incrementally on a stream (`CallParser.feed`/`flush`): content outside a
call streams as it comes, held back only while it might be the start of a call marker;
a call is sent whole (name and arguments) once it is complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from modelship.engine.grammar_spec import JSON_WHITESPACE, GrammarSpec
from modelship.server import protocol as p
from modelship.server.errors import BadRequestError

FORMATS = ("hermes", "llama3_json", "mistral", "generic")
_START, _END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL = "[TOOL_CALLS]"


def detect_format(template: str) -> str:
    """The tool-call form a chat template teaches, from its source."""
    if _MISTRAL in template:
        return "mistral"
    if _PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    if _START in template or "tools" in template:
        return "hermes"
    return "generic"


@dataclass(frozen=True)
class ToolUse:
    """A request's tools as the prompt and the parser use them."""

    tools: list[dict[str, Any]]  # OpenAI tool objects ({"type": "function", "function": ...})
    format: str
    parallel: bool = True

    @property
    def in_template(self) -> bool:
        return self.format != "generic"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_api(self) -> p.ToolCallOut:
        return p.ToolCallOut(
            id=self.id, function=p.FunctionCall(name=self.name, arguments=self.arguments)
        )


def tool_use(request: p.ChatCompletionRequest, form: str) -> ToolUse | None:
    """None when the request has no tools or `tool_choice: "none"` (the model is then
    neither told of them nor parsed for calls)."""
    if not request.tools or request.tool_choice == "none":
        return None
    names = {tool.function.name for tool in request.tools}
    choice = request.tool_choice
    if isinstance(choice, p.NamedToolChoice) and choice.function.name not in names:
        raise BadRequestError(
            f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice"
        )
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    return ToolUse(tools, form, request.parallel_tool_calls)


def forced_calls(use: ToolUse, choice: object) -> GrammarSpec | None:
    """`tool_choice: "required"` or a named tool: the answer must be calls (to that tool),
    written in the form the parser reads, each call's arguments held to its tool's
    `parameters` schema, so they always validate. None for `auto` (free text, parsed)."""
    if choice == "required":
        tools = use.tools
    elif isinstance(choice, p.NamedToolChoice):
        tools = [tool for tool in use.tools if tool["function"]["name"] == choice.function.name]
    else:
        return None
    rules = _calls_rules(use, tools, many=use.parallel and choice == "required")
    return GrammarSpec("grammar", "start: calls\n" + rules, param="tool_choice")


def calls_or_json(use: ToolUse, spec: GrammarSpec) -> GrammarSpec:
    """`tool_choice: "auto"` with a JSON `response_format`: the answer is calls, or the JSON
    the format asks for (as OpenAI answers such a request); other grammars stand alone."""
    if spec.kind not in ("json_schema", "json_object"):
        return spec
    schema = json.loads(spec.spec) if spec.kind == "json_schema" else {"type": "object"}
    schema.setdefault("x-guidance", {"whitespace_pattern": JSON_WHITESPACE})
    rules = _calls_rules(use, use.tools, many=use.parallel)
    grammar = f"start: calls | answer\nanswer: %json {json.dumps(schema)}\n{rules}"
    return GrammarSpec("grammar", grammar, param=spec.param)


def _calls_rules(use: ToolUse, tools: list[dict[str, Any]], many: bool) -> str:
    """Lark rules whose `calls` is one call (`many`: one or more) to one of `tools`."""
    key = "parameters" if use.format == "llama3_json" else "arguments"
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    key: _closed(tool["function"].get("parameters") or {"type": "object"}),
                },
                "required": ["name", key],
                "additionalProperties": False,
            }
            for tool in tools
        ],
        # one space at most between JSON tokens: a weak model under the grammar otherwise
        # may pad with whitespace until max_tokens (the tiny test model did)
        "x-guidance": {"whitespace_pattern": "[ ]?"},
    }
    if use.format == "mistral":  # a JSON list of calls (the marker is a special token)
        calls = {"type": "array", "items": call, "minItems": 1, **({} if many else {"maxItems": 1})}
        return f"calls: %json {json.dumps(calls)}\n"
    if use.format == "llama3_json":
        more = ' (";" call)*' if many else ""
        return f"calls: call{more}\ncall: %json {json.dumps(call)}\n"
    marked = '"' + _START + '\\n" body "\\n' + _END + '"'
    more = ' ("\\n" call)*' if many else ""
    return f"calls: call{more}\ncall: {marked}\nbody: %json {json.dumps(call)}\n"


def _closed(schema: Any) -> Any:
    """A parameters schema whose objects take no property they do not name, unless they say
    so (`additionalProperties`): a function has the arguments it declares, and a weak model
    under an open schema invents keys until max_tokens (the tiny test model did). OpenAI's
    strict mode and xgrammar's default read schemas the same way."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items() if key != "properties"}
    if isinstance(schema.get("properties"), dict):  # names -> schemas (a name is no keyword)
        closed["properties"] = {name: _closed(sub) for name, sub in schema["properties"].items()}
    if "properties" in schema and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


# The prompt -------------------------------------------------------------------------------
def template_messages(messages: list[p.ChatMessage], use: ToolUse | None) -> list[dict]:
    """The conversation as chat templates take it (transformers' form): an assistant turn's
    `tool_calls` with their arguments as objects, a tool turn with its `tool_call_id`. For
    a template without tool support, the same as plain text turns (see the module doc)."""
    rendered: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        turn: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            calls = [_template_call(call, i) for call in message.tool_calls]
            if use is not None and not use.in_template:
                blocks = [f"{_START}\n{json.dumps(c['function'])}\n{_END}" for c in calls]
                turn["content"] = "\n".join([turn["content"], *blocks]).strip()
            else:
                turn["tool_calls"] = calls
        if message.role == "tool":
            if use is not None and not use.in_template:
                turn = {
                    "role": "user",
                    "content": f"<tool_response>\n{message.text()}\n</tool_response>",
                }
            elif message.tool_call_id is not None:
                turn["tool_call_id"] = message.tool_call_id
        rendered.append(turn)
    if use is not None and not use.in_template:
        rendered = _with_tools_described(rendered, use.tools)
    return rendered


def _template_call(call: p.ToolCallOut, i: int) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise BadRequestError(
            f"messages.{i}.tool_calls: arguments of {call.function.name!r} are not JSON",
            f"messages.{i}.tool_calls",
        ) from None
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def _with_tools_described(messages: list[dict], tools: list[dict]) -> list[dict]:
    schemas = "\n".join(json.dumps(tool["function"]) for tool in tools)
    guide = (
        "You can call these tools (JSON schemas):\n<tools>\n" + schemas + "\n</tools>\n"
        "To call a tool, answer with one block per call and nothing else:\n"
        f'{_START}\n{{"name": "<tool name>", "arguments": {{<its arguments>}}}}\n{_END}'
    )
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": messages[0]["content"] + "\n\n" + guide}
        return [first, *messages[1:]]
    return [{"role": "system", "content": guide}, *messages]


# The answer ---------------------------------------------------------------------------------
@dataclass
class Parsed:
    """What a piece of answer text holds: content to show, and whole calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def parse(text: str, use: ToolUse) -> Parsed:
    parser = CallParser(use)
    first, last = parser.feed(text), parser.flush()
    return Parsed(first.content + last.content, first.calls + last.calls)


class CallParser:
    """Incremental: `feed` each piece of text as it is generated, `flush` at the end."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.pending = ""  # text held back: a possible marker start, or a call being written
        self.inside = False  # within <tool_call> ... </tool_call>
        self.leading: bool | None = None  # llama3/mistral: the answer opened with a call
        self.num_calls = 0

    def feed(self, text: str) -> Parsed:
        self.pending += text
        if self.use.format in ("llama3_json", "mistral"):
            return self._feed_leading()
        return self._feed_marked()

    def flush(self) -> Parsed:
        rest, self.pending = self.pending, ""
        if self.use.format in ("llama3_json", "mistral"):
            calls = _leading_calls(rest, self.use.format) if self.leading else None
            return self._keep(Parsed(calls=calls)) if calls else Parsed(content=rest)
        if self.inside:  # a call whose end marker never came (a stop, or EOS, took it)
            call = _call(rest)
            self.inside = False
            return self._keep(Parsed(calls=[call])) if call else Parsed(_START + rest)
        return Parsed(content=rest)

    def _feed_marked(self) -> Parsed:
        out = Parsed()
        while True:
            if not self.inside:
                start = self.pending.find(_START)
                if start < 0:
                    shown = len(self.pending) - _partial_marker(self.pending, _START)
                    out.content += self.pending[:shown]
                    self.pending = self.pending[shown:]
                    return out
                out.content += self.pending[:start]
                self.pending = self.pending[start + len(_START) :]
                self.inside = True
            end = self.pending.find(_END)
            if end < 0:
                return out
            body, self.pending = self.pending[:end], self.pending[end + len(_END) :]
            self.inside = False
            call = _call(body)
            if call is None:  # not a call after all: the text as written
                out.content += _START + body + _END
            else:
                out.calls += self._keep(Parsed(calls=[call])).calls

    def _feed_leading(self) -> Parsed:
        if self.leading is None:
            head = self.pending.lstrip()
            openers = (_PYTHON_TAG, "{") if self.use.format == "llama3_json" else (_MISTRAL, "[")
            if not head or any(o.startswith(head) for o in openers):
                return Parsed()  # too little to tell
            self.leading = head.startswith(openers)
        if self.leading:
            return Parsed()  # all of it is parsed at the end
        shown, self.pending = self.pending, ""
        return Parsed(content=shown)

    def _keep(self, parsed: Parsed) -> Parsed:
        """Only the first call when the request asked for no parallel calls."""
        if not self.use.parallel:
            parsed.calls = parsed.calls[: max(0, 1 - self.num_calls)]
        self.num_calls += len(parsed.calls)
        return parsed


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _call(text: str) -> ToolCall | None:
    try:
        value = json.loads(text.strip())
    except ValueError:
        return None
    return _call_of(value)


def _call_of(value: object) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments))


def _leading_calls(text: str, form: str) -> list[ToolCall] | None:
    """The calls of an answer that is only calls, or None if it is not."""
    body = text.strip().removeprefix(_PYTHON_TAG if form == "llama3_json" else _MISTRAL).strip()
    values: list[Any] = []
    decoder, at = json.JSONDecoder(), 0
    try:
        while at < len(body):  # JSON values, joined by `;` or whitespace
            value, at = decoder.raw_decode(body, at)
            values += value if isinstance(value, list) else [value]
            while at < len(body) and body[at] in "; \n\t":
                at += 1
    except ValueError:
        return None
    calls = [_call_of(value) for value in values]
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]
