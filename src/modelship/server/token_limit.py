"""Token-id lists bounded on the raw body, before pydantic validates them (pure ASGI).

A completion's `prompt` of 4 million token ids (7.6 MiB, under the body cap) kept the
event loop 5.3 s in pydantic, +0.9 GB, before any length check: /ready went unanswered,
the gateway took the replica for dead and sent the same body to the next one. Here the
body is read first. With fewer commas than `max_model_len` no list in it can be longer
(the common case: one count at memchr speed); any other body is parsed with `json.loads`
(a fraction of pydantic's cost) and its lists counted: a prompt longer than
`max_model_len` token ids, more prompts than `max_prompts`, `resume_token_ids` longer
than `max_model_len`, more `stop_token_ids` than `max_stop`, a `logit_bias` of more
than 300 entries (OpenAI's bound), or more chat `messages` (or Responses `input` items)
than `max_model_len` (every message renders to one token at least, so more cannot fit; a
million `{}` kept the loop in pydantic the same way) is a 400 naming the field.
Everything else goes on unchanged, the body replayed to the app.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from modelship.engine.sampling_params import MAX_LOGIT_BIAS_ENTRIES
from modelship.prompt_bounds import PromptBound, exceeded_bound
from modelship.server import protocol as p
from modelship.server.errors import BadRequestError
from modelship.server.limits import RequestLimitsConfig

_Message = dict[str, Any]
_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")


class TokenIdLimit:
    def __init__(self, app: Any, max_model_len: int, limits: RequestLimitsConfig) -> None:
        self.app = app
        self.max_model_len = max_model_len
        self.limits = limits

    async def __call__(self, scope: _Message, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in _PATHS:
            await self.app(scope, receive, send)
            return
        messages = []
        while True:  # the body (capped by `body_limit` outside this layer)
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        error = self.check(body, scope["path"])
        if error is not None:
            content = p.ErrorResponse.of(error.message, error.error_type, error.param, error.code)
            await JSONResponse(content.model_dump(), status_code=400)(scope, receive, send)
            return
        replay = iter(messages)

        async def replayed() -> _Message:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)

    def check(self, body: bytes, path: str = "/v1/completions") -> BadRequestError | None:
        """The first list over its bound, as the client's error; None if none is."""
        if body.count(b",") < self.max_model_len:
            return None  # no list holds more than max_model_len items
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):
            return None  # the app answers what is wrong with it
        if not isinstance(request, dict):
            return None
        if path == "/v1/embeddings":  # `input` is an embedding request's prompt
            return self._check_prompt(request.get("input"), "input")
        return self._check_prompt(request.get("prompt")) or self._check_lists(request)

    def _check_prompt(self, prompt: object, field: str = "prompt") -> BadRequestError | None:
        if not isinstance(prompt, list):
            return None
        exceeded = exceeded_bound(prompt, self.limits.max_prompts, self.max_model_len)
        if exceeded is PromptBound.PROMPTS:
            return BadRequestError(
                f"{field} takes at most {self.limits.max_prompts} prompts per request", field
            )
        if exceeded is PromptBound.TOKEN_IDS:
            return BadRequestError(
                f"{field}: a prompt takes at most {self.max_model_len} token ids (this model's "
                "maximum context length)",
                field,
            )
        return None

    def _check_lists(self, request: dict) -> BadRequestError | None:
        for name in ("messages", "input"):  # chat messages, Responses input items
            messages = request.get(name)
            if isinstance(messages, list) and len(messages) > self.max_model_len:
                return BadRequestError(
                    f"{name}: at most {self.max_model_len} messages (this model's maximum "
                    "context length in tokens; each message takes one at least)",
                    name,
                )
        resumed = request.get("resume_token_ids")
        if isinstance(resumed, list) and len(resumed) > self.max_model_len:
            return BadRequestError(
                f"resume_token_ids: at most {self.max_model_len} token ids", "resume_token_ids"
            )
        stop_ids = request.get("stop_token_ids")
        if isinstance(stop_ids, list) and len(stop_ids) > self.limits.max_stop:
            return BadRequestError(
                f"stop_token_ids takes at most {self.limits.max_stop} ids", "stop_token_ids"
            )
        bias = request.get("logit_bias")
        if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            return BadRequestError(
                f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias"
            )
        return None
