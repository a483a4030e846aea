"""The Responses API (`POST /v1/responses`) as a translation of chat completions.

Stateless: a request carries the whole conversation (`input`, `instructions`), becomes one
chat-completion request, and the chat answer (whole, or its SSE chunks) becomes a
`response` object or the Responses event sequence. Both the replica (`server/responses.py`)
and the gateway (`gateway/responses.py`) translate with this module, so a response through
the gateway is a chat completion there: routed, retried, resumed on failover and counted
like any other.

Dicts in, dicts out (and chat SSE text in, Responses SSE text out: `translate_stream`), no
I/O of its own. Fields of the Responses spec that the translation cannot honour
are refused by name (`ResponsesRequestError`, a 400), never dropped.
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

PATH = "/v1/responses"
CHAT_PATH = "/v1/chat/completions"

# Spec fields this server does not implement, with why; a request that sets one (to
# anything but its off value: None, False, [] or "") is refused naming it.
UNSUPPORTED = {
    "previous_response_id": "responses are not stored; send the whole conversation as input",
    "conversation": "responses are not stored; send the whole conversation as input",
    "background": "background responses are not supported",
    "prompt": "stored prompt templates are not supported",
    "include": "extra output data (include) is not supported",
    "reasoning": "reasoning options are not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "a bound on tool calls is not supported",
    "context_management": "context management is not supported",
    "moderation": "moderation is not supported",
    "image": "image generation is not supported",
    "prompt_cache_options": "prompt cache options are not supported",
    "prompt_cache_retention": "prompt cache retention is not supported",
}
# Accepted and without effect here (echoed where the response object has the field).
IGNORED = (
    "metadata",
    "safety_identifier",
    "prompt_cache_key",
    "service_tier",
    "stream_options",
    "parallel_tool_calls",
    "truncation",
)
# Not Responses fields: sampling extras that chat requests take (vLLM accepts them on
# /v1/responses too), passed through as they are.
PASSED_THROUGH = (
    "seed",
    "stop",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "priority",
)
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")


class ResponsesRequestError(ValueError):
    """A request this translation refuses: a 400 whose `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.message = f"{param}: {message}"
        self.param = param


@dataclass(frozen=True)
class ResponsesRequest:
    """A client's Responses request and the chat-completion request it becomes."""

    body: dict[str, Any]
    chat: dict[str, Any]
    response_id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def stream(self) -> bool:
        return bool(self.chat.get("stream"))


def translate_request(body: object) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise ResponsesRequestError("the request body must be a JSON object", "body")
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, False, [], ""):
            raise ResponsesRequestError(why, name)
    if body.get("store"):
        raise ResponsesRequestError("responses are not stored; send store: false", "store")
    if body.get("truncation") not in (None, "disabled"):
        raise ResponsesRequestError("only 'disabled' is supported", "truncation")
    tools = _tools(body.get("tools"))
    messages = _instructions(body.get("instructions")) + _input_messages(body.get("input"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(body.get("tool_choice"))
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None:
        if isinstance(max_output_tokens, bool) or not isinstance(max_output_tokens, int):
            raise ResponsesRequestError("must be a positive integer", "max_output_tokens")
        if max_output_tokens < 1:
            raise ResponsesRequestError("must be a positive integer", "max_output_tokens")
        chat["max_tokens"] = max_output_tokens
    for name in ("temperature", "top_p", "user", *PASSED_THROUGH):
        if body.get(name) is not None:
            chat[name] = body[name]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # response.completed carries usage
    return ResponsesRequest(body=body, chat=chat)


def _instructions(instructions: object) -> list[dict[str, str]]:
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise ResponsesRequestError("a string is required", "instructions")
    return [{"role": "system", "content": instructions}]


def _input_messages(items: object) -> list[dict[str, Any]]:
    """`input`: a string (one user message) or a list of items: messages (content a string
    or text parts), `function_call` items (consecutive ones: one assistant turn's
    `tool_calls`) and `function_call_output` items (tool turns). Other items (images, files,
    reasoning) are refused."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ResponsesRequestError("a string or a non-empty list of items is required", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ResponsesRequestError(f"item {i} is not an object", "input")
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {
                "id": _text_field(item, "call_id", i),
                "type": "function",
                "function": {
                    "name": _text_field(item, "name", i),
                    "arguments": _text_field(item, "arguments", i),
                },
            }
            if messages and messages[-1].get("tool_calls") and not messages[-1]["content"]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, i)
            messages.append(
                {"role": "tool", "tool_call_id": _text_field(item, "call_id", i), "content": text}
            )
        elif kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise ResponsesRequestError(
                    f"item {i}: role must be one of {', '.join(_ROLES)}", "input"
                )
            messages.append({"role": role, "content": _text_of(item.get("content"), i)})
        else:
            raise ResponsesRequestError(
                f"item {i}: items of type {kind!r} are not supported", "input"
            )
    return messages


def _text_field(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ResponsesRequestError(f"item {i}: {name} must be a string", "input")
    return value


def _tools(tools: object) -> list[dict[str, Any]]:
    """Function tools as chat tools; other kinds (web search, files, MCP...) are refused."""
    if tools in (None, []):
        return []
    if not isinstance(tools, list):
        raise ResponsesRequestError("a list of tools is required", "tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ResponsesRequestError(
                f"tool {i}: only function tools are supported, not {kind!r}", "tools"
            )
        function = {
            k: tool[k]
            for k in ("name", "description", "parameters", "strict")
            if tool.get(k) is not None
        }
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _tool_choice(choice: object) -> object:
    if choice is None or choice in ("none", "auto", "required"):
        return choice or "auto"
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ResponsesRequestError(
        "none, auto, required or a function tool is required", "tool_choice"
    )


def _text_of(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise ResponsesRequestError(
                    f"item {i}: content parts of type {kind!r} are not supported (text only)",
                    "input",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ResponsesRequestError(f"item {i}: content must be a string or text parts", "input")


def _response_format(text: object) -> dict[str, Any] | None:
    """`text.format` as a chat `response_format` (structured outputs)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ResponsesRequestError("an object is required", "text")
    spec = text.get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: spec[k] for k in ("name", "schema", "strict", "description") if k in spec}
        return {"type": "json_schema", "json_schema": schema}
    raise ResponsesRequestError("type must be text, json_object or json_schema", "text.format")


# Responses from chat answers ----------------------------------------------------------------
def translate_response(request: ResponsesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion as a `response` object: a message item for its text (if
    any), a `function_call` item per tool call."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("content"):
        output.append(_message(request, message["content"], "completed"))
    output += [_function_call(call, "completed") for call in message.get("tool_calls") or []]
    return _response(request, "completed", output, chat.get("usage"), choice.get("finish_reason"))


def _message(request: ResponsesRequest, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text)] if status != "in_progress" else []
    return {
        "id": request.message_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call(call: dict[str, Any], status: str) -> dict[str, Any]:
    function = call["function"]
    return {
        "id": f"fc_{call['id']}",
        "type": "function_call",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] or "",
        "status": status,
    }


def _response(
    request: ResponsesRequest,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    finish_reason: str | None,
) -> dict[str, Any]:
    body = request.body
    incomplete = None
    if finish_reason == "length":  # the answer ended at max_output_tokens
        status = "incomplete"
        incomplete = {"reason": "max_output_tokens"}
        for item in output:
            item["status"] = "incomplete"
    text_format = (body.get("text") or {}).get("format") or {"type": "text"}
    return {
        "id": request.response_id,
        "object": "response",
        "created_at": request.created_at,
        "status": status,
        "model": body.get("model"),
        "output": output,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "text": {"format": text_format},
        "truncation": "disabled",
        "store": False,
        "background": False,
        "previous_response_id": None,
        "user": body.get("user"),
        "usage": _usage(usage),
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


class ResponseEvents:
    """The Responses event sequence of one streamed answer, fed the chat stream's chunks:
    `response.created`, `response.in_progress`; the message item opened at the first text
    (`response.output_item.added`, `response.content_part.added`) and a
    `response.output_text.delta` per chunk with text; a tool call (whole in the chat
    stream) as a `function_call` item with its arguments in one delta; then every open item
    closed and `response.completed` (or `response.incomplete`; `error` +
    `response.failed` for a stream that fails)."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request = request
        self.text: list[str] | None = None  # the message's text, once it is open
        self.output: list[dict[str, Any]] = []  # closed items, in order
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.sequence_number = 0
        self.ended = False

    def start(self) -> list[dict[str, Any]]:
        opening = _response(self.request, "in_progress", [], None, None)
        return [
            self._event("response.created", response=opening),
            self._event("response.in_progress", response=opening),
        ]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one chat chunk (a parsed SSE `data:` payload)."""
        if self.ended:
            return []
        if "error" in chunk:
            return self._fail(chunk["error"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._open_message()
                self.text.append(delta["content"])  # type: ignore[union-attr]
                events.append(
                    self._event(
                        "response.output_text.delta",
                        **self._at(),
                        delta=delta["content"],
                        logprobs=[],
                    )
                )
            for call in delta.get("tool_calls") or []:
                events += self._close_message() + self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The closing events, once the chat stream ended (`[DONE]`)."""
        if self.ended:
            return []
        events = self._close_message()
        self.ended = True
        final = _response(self.request, "completed", self.output, self.usage, self.finish_reason)
        last = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [*events, self._event(last, response=final)]

    def _open_message(self) -> list[dict[str, Any]]:
        if self.text is not None:
            return []
        self.text = []
        item = _message(self.request, "", "in_progress")
        return [
            self._event("response.output_item.added", output_index=len(self.output), item=item),
            self._event("response.content_part.added", **self._at(), part=_text_part("")),
        ]

    def _close_message(self) -> list[dict[str, Any]]:
        if self.text is None or self.ended:
            return []
        text, self.text = "".join(self.text), None
        status = "incomplete" if self.finish_reason == "length" else "completed"
        item = _message(self.request, text, status)
        events = [
            self._event("response.output_text.done", **self._at(), text=text, logprobs=[]),
            self._event("response.content_part.done", **self._at(), part=_text_part(text)),
            self._event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index = len(self.output)
        item = _function_call(call, "completed")
        at = {"item_id": item["id"], "output_index": index}
        self.output.append(item)
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            self._event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
            self._event(
                "response.function_call_arguments.done",
                **at,
                arguments=item["arguments"],
                name=item["name"],
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        self.ended = True
        failed = _response(self.request, "failed", self.output, self.usage, None)
        failed["error"] = {
            "code": error.get("code") or "server_error",
            "message": error.get("message", ""),
        }
        return [
            self._event(
                "error",
                code=error.get("code"),
                message=error.get("message", ""),
                param=error.get("param"),
            ),
            self._event("response.failed", response=failed),
        ]

    def _at(self) -> dict[str, Any]:
        index = len(self.output)  # the open message is the next item
        return {"item_id": self.request.message_id, "output_index": index, "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event


def sse_event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def chat_chunks(sse_text: str) -> list[dict[str, Any] | None]:
    """The payloads of whole SSE events in `sse_text`: a dict per `data:` line, None for
    `[DONE]`. Comment and `event:` lines are skipped."""
    payloads: list[dict[str, Any] | None] = []
    for line in sse_text.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        payloads.append(None if data == "[DONE]" else json.loads(data))
    return payloads


async def translate_stream(
    request: ResponsesRequest, chat_stream: AsyncIterator[str | bytes]
) -> AsyncIterator[str]:
    """The Responses event stream of a chat completion's SSE stream, text or bytes in pieces
    of any size (a piece may end inside an event or a character). The stream always closes
    its response: a chat stream cut without `[DONE]` (the client hung up, a replica died)
    ends in `response.completed`/`incomplete`/`failed` all the same, and the chat stream is
    closed with this one (a client that hangs up aborts the generation)."""
    events = ResponseEvents(request)
    for event in events.start():
        yield sse_event(event)
    utf8 = codecs.getincrementaldecoder("utf-8")()
    pending = ""
    try:
        async for piece in chat_stream:
            pending += utf8.decode(piece) if isinstance(piece, bytes) else piece
            whole, _, pending = pending.rpartition("\n\n")  # events end with a blank line
            for chunk in chat_chunks(whole):
                for event in events.finish() if chunk is None else events.feed(chunk):
                    yield sse_event(event)
    finally:
        close = getattr(chat_stream, "aclose", None)
        if close is not None:
            await close()
    for chunk in chat_chunks(pending):  # a last event without its blank line
        for event in events.finish() if chunk is None else events.feed(chunk):
            yield sse_event(event)
    for event in events.finish():
        yield sse_event(event)
