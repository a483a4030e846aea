"""The Responses API (`POST /v1/responses`) as a translation of chat completions.

Stateless: a request carries the whole conversation (`input`, `instructions`), becomes one
chat-completion request, and the chat answer (whole, or its SSE chunks) becomes a
`response` object or the Responses event sequence. Both the replica (`server/responses.py`)
and the gateway (`gateway/responses.py`) translate with this module, so a response through
the gateway is a chat completion there: routed, retried, resumed on failover and counted
like any other.

Dicts in, dicts out, no I/O. Fields of the Responses spec that the translation cannot honour
are refused by name (`ResponsesRequestError`, a 400), never dropped.
"""

from __future__ import annotations

import json
import time
import uuid
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
    "max_tool_calls": "tool calling is not supported on /v1/responses yet",
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
    if body.get("tools"):
        raise ResponsesRequestError("tool calling is not supported on /v1/responses yet", "tools")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise ResponsesRequestError(
            "tool calling is not supported on /v1/responses yet", "tool_choice"
        )
    messages = _instructions(body.get("instructions")) + _input_messages(body.get("input"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
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


def _input_messages(items: object) -> list[dict[str, str]]:
    """`input`: a string (one user message) or a list of message items whose content is a
    string or text parts. Other items (function calls, images, files) are refused."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ResponsesRequestError("a string or a non-empty list of items is required", "input")
    messages = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ResponsesRequestError(f"item {i} is not an object", "input")
        kind = item.get("type", "message")
        if kind != "message":
            raise ResponsesRequestError(
                f"item {i}: items of type {kind!r} are not supported", "input"
            )
        role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise ResponsesRequestError(
                f"item {i}: role must be one of {', '.join(_ROLES)}", "input"
            )
        messages.append({"role": role, "content": _text_of(item.get("content"), i)})
    return messages


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
    """A whole chat completion as a `response` object."""
    choice = chat["choices"][0]
    text = choice["message"].get("content") or ""
    return _response(
        request,
        "completed",
        [_message(request, text, "completed")],
        chat.get("usage"),
        choice.get("finish_reason"),
    )


def _message(request: ResponsesRequest, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "id": request.message_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content if text or status != "in_progress" else [],
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
        "tools": [],
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
    created, in_progress, the message item and its text part opened, one
    `response.output_text.delta` per chunk with text, then everything closed and
    `response.completed` (or `response.incomplete`, or `error` + `response.failed`)."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request = request
        self.text: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.sequence_number = 0
        self.ended = False

    def start(self) -> list[dict[str, Any]]:
        opening = _response(self.request, "in_progress", [], None, None)
        item = _message(self.request, "", "in_progress")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.created", response=opening),
            self._event("response.in_progress", response=opening),
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **self._at(), part=part),
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
            delta = (choice.get("delta") or {}).get("content")
            if delta:
                self.text.append(delta)
                events.append(
                    self._event(
                        "response.output_text.delta", **self._at(), delta=delta, logprobs=[]
                    )
                )
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The closing events, once the chat stream ended (`[DONE]`)."""
        if self.ended:
            return []
        self.ended = True
        text = "".join(self.text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        final = _response(
            self.request,
            "completed",
            [_message(self.request, text, "completed")],
            self.usage,
            self.finish_reason,
        )
        item = final["output"][0]
        last = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [
            self._event("response.output_text.done", **self._at(), text=text, logprobs=[]),
            self._event("response.content_part.done", **self._at(), part=part),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event(last, response=final),
        ]

    def _fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        self.ended = True
        failed = _response(self.request, "failed", [], self.usage, None)
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
        return {"item_id": self.request.message_id, "output_index": 0, "content_index": 0}

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
