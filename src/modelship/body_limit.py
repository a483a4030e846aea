"""A cap on request body size for the server and the gateway (pure ASGI, no framework).

Without one, a client can make a process buffer any body it sends (a JSON parser holds the
whole body, then its objects, several times its size) before a field check could refuse
it. A declared Content-Length over the cap is refused before the body is read; a chunked
body is counted as it arrives and refused as soon as it passes the cap. Either way the
client gets 413 with an OpenAI error body.
"""

from __future__ import annotations

import json
from typing import Any

DEFAULT_MAX_BODY_MB = 16
_Message = dict[str, Any]


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: _Message, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._refuse(send)
                return
        received = 0
        too_large = False
        answered = False

        async def counted_receive() -> _Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _TooLarge
            return message

        async def watched_send(message: _Message) -> None:
            nonlocal answered
            if too_large:  # the app's own answer to a cut body (FastAPI: a 400) is replaced
                if not answered and message["type"] == "http.response.start":
                    answered = True
                    await self._refuse(send)
                return
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _TooLarge:
            if not answered:
                await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        megabytes = self.max_bytes / 2**20
        body = json.dumps({"error": {
            "message": f"request body larger than {megabytes:g} MiB",
            "type": "invalid_request_error", "param": None, "code": "request_too_large",
        }}).encode()  # fmt: skip
        await send({
            "type": "http.response.start", "status": 413,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close")],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": body})
