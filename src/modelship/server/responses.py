"""`POST /v1/responses`: the Responses API over the chat-completion path
(`responses_api.py` translates both ways; nothing here is stored)."""

from __future__ import annotations

import json
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
    return responses_api.translate_stream(request, _chat_stream(answer))


async def _chat_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The chat stream with a failure after the headers as the error event a replica's chat
    stream carries, which the translation answers the Responses way (`response.failed`)."""
    try:
        async with aclosing(chunks):  # a client that hangs up closes the chat stream: aborted
            async for text in chunks:
                yield text
    except APIError as exc:
        error = {"message": exc.message, "code": exc.code, "param": exc.param}
        yield f"data: {json.dumps({'error': error})}\n\n"
