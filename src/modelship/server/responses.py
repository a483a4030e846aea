"""`POST /v1/responses`: the Responses API over the chat-completion path
(`responses_api.py` translates both ways; nothing here is stored)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from modelship import responses_api
from modelship.server import protocol as p
from modelship.server.chat import create_chat_completion
from modelship.server.errors import APIError, BadRequestError
from modelship.server.gateway_hints import GatewayHints
from modelship.server.openai_translation import OpenAIServing


async def create_response(
    serving: OpenAIServing, body: object, hints: GatewayHints
) -> dict[str, Any] | AsyncIterator[str]:
    """A `response` object, or the event stream; errors raise `APIError` before any byte."""
    try:
        request = responses_api.translate_request(body)
    except responses_api.ResponsesRequestError as exc:
        raise BadRequestError(exc.message, exc.param) from None
    try:
        chat = p.ChatCompletionRequest.model_validate(request.chat)
    except ValidationError as exc:  # answered like a chat request's (field named)
        raise RequestValidationError(exc.errors()) from None
    answer = await create_chat_completion(serving, chat, hints)
    if isinstance(answer, p.ChatCompletionResponse):
        return responses_api.translate_response(request, answer.model_dump())
    return _events(request, answer)


async def _events(
    request: responses_api.ResponsesRequest, chunks: AsyncIterator[str]
) -> AsyncIterator[str]:
    events = responses_api.ResponseEvents(request)
    for event in events.start():
        yield responses_api.sse_event(event)
    try:
        async with aclosing(chunks):  # a client that hangs up closes the chat stream: aborted
            async for text in chunks:
                for chunk in responses_api.chat_chunks(text):
                    for event in events.finish() if chunk is None else events.feed(chunk):
                        yield responses_api.sse_event(event)
    except APIError as exc:  # after the headers: the Responses way to fail, not a cut stream
        error = {"message": exc.message, "code": exc.code, "param": exc.param}
        for event in events.feed({"error": error}):
            yield responses_api.sse_event(event)
    for event in events.finish():  # a stream cut without [DONE] still closes its response
        yield responses_api.sse_event(event)
