"""`POST /v1/responses` through the gateway: translated to a chat completion at the edge
(`responses_api.py`), so the request is authenticated, admitted, routed, retried, resumed on
failover and counted by the one chat path, and its answer translated back. Error answers
(OpenAI error bodies) pass through unchanged."""

from __future__ import annotations

import json

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message

from modelship import responses_api
from modelship.gateway.request import GatewayError
from modelship.gateway.service import GatewayService

_HOP_HEADERS = {"content-length", "content-type"}  # recomputed for the translated body


async def respond(service: GatewayService, request: Request) -> Response:
    try:
        body = json.loads(await request.body())
        translated = responses_api.translate_request(body)
    except ClientDisconnect:
        return Response(status_code=499)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, responses_api.ResponsesRequestError):
            return GatewayError(400, exc.message, param=exc.param).response()
        return GatewayError(400, "We could not parse the JSON body of your request.").response()
    answer = await service.handle(_as_chat_request(request, translated))
    if answer.status_code != 200:
        return answer
    headers = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_HEADERS}
    if isinstance(answer, StreamingResponse):
        events = responses_api.translate_stream(translated, answer.body_iterator)
        return StreamingResponse(
            events, headers=headers, media_type="text/event-stream", background=answer.background
        )
    chat = json.loads(answer.body)
    return JSONResponse(responses_api.translate_response(translated, chat), headers=headers)


def _as_chat_request(request: Request, translated: responses_api.ResponsesRequest) -> Request:
    """The client's request, as a chat completion: same headers and connection, the chat
    body and path. After the body, `receive` is the client's own (a hang-up still shows)."""
    chat_body = json.dumps(translated.chat).encode()
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": chat_body, "more_body": False}
        return await request.receive()

    path = responses_api.CHAT_PATH
    scope = dict(request.scope, path=path, raw_path=path.encode())
    return Request(scope, receive)
