"""What the gateway reads from a client request, and the errors it answers itself.

The gateway parses only what it needs to authenticate, limit and route (model, prompt
size, max_tokens, stream, session keys); the replica validates the rest and its 400s pass
through unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

from modelship.gateway.admission import retry_after_header
from modelship.gateway.config import RequestLimitsConfig
from modelship.gateway.endpoint import RoutingRequest, chat_prefix_text, estimate_num_tokens
from modelship.gateway.tiers import TIER_HEADER
from modelship.prompt_bounds import PromptBound, exceeded_bound
from modelship.request_id import REQUEST_ID_HEADER

# Body fields only the gateway's mid-stream failover sets (`failover.py`): from a client,
# `resume_token_ids` would be arbitrary token ids (special ones included) taken as output
# already generated, outside the tenant's input and output caps.
FAILOVER_FIELDS = ("resume_token_ids", "return_token_ids")


@dataclass
class GatewayError(Exception):
    """An error the gateway answers itself, as an OpenAI error body."""

    status_code: int
    message: str
    error_type: str = "invalid_request_error"
    code: str | None = None
    retry_after_s: float | None = None
    param: str | None = None  # the field (or header) at fault

    def response(
        self, request_id: str | None = None, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }
        headers = dict(headers or {})
        if self.retry_after_s is not None:
            headers["retry-after"] = retry_after_header(self.retry_after_s)
        if request_id:
            headers[REQUEST_ID_HEADER] = request_id
        return JSONResponse(body, status_code=self.status_code, headers=headers)


def unauthorized() -> GatewayError:
    message = "Incorrect or missing API key."
    return GatewayError(401, message, "authentication_error", "invalid_api_key")


def unavailable(message: str, retry_after_s: float = 1.0) -> GatewayError:
    return GatewayError(503, message, "service_unavailable", "service_unavailable", retry_after_s)


_REFUSAL_TYPES = {
    403: "permission_error",
    400: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",  # the shared quota store did not answer
}


def refused(
    status_code: int,
    message: str,
    code: str,
    retry_after_s: float | None = None,
    param: str | None = None,
) -> GatewayError:
    """A tenant's limit refusing a request: 403, 400, 429, or 503 where its quotas could not
    be read (the last two with a Retry-After)."""
    error_type = _REFUSAL_TYPES.get(status_code, "invalid_request_error")
    retry_after_s = retry_after_s if status_code in (429, 503) else None
    return GatewayError(status_code, message, error_type, code, retry_after_s, param)


@dataclass
class ParsedRequest:
    """One chat or completion request as the gateway sees it."""

    body: dict[str, Any]
    model: str
    stream: bool
    max_tokens: int | None
    input_tokens: int  # exact for token ids; for text estimated from its UTF-8 bytes
    prefix_text: str
    user: str | None
    session_id: str | None
    input_is_exact: bool = False  # a prompt of token ids: `input_tokens` is their count
    # Sequences the replica will run at once: `n` per prompt (a completion may list several
    # prompts). Each holds an admission and a tenant concurrency slot, and is priced.
    num_sequences: int = 1
    raw: bytes = b""  # the body as the client sent it
    requested_tier: str | None = None  # the tier the client named (`x-modelship-tier`)
    # The model whose replicas serve it (`models.ModelCatalog.resolve`; None: the primary).
    served_model: str | None = None
    # The model tier (`tiers.TierConfig.model`) that sends it to another model, if one does.
    model_tier: str | None = None
    changed: dict[str, Any] = field(default_factory=dict)  # fields the gateway set (`set`)

    def set(self, key: str, value: Any) -> None:
        """Set a field of the body the replica gets."""
        self.body[key] = value
        self.changed[key] = value

    def encode(self, **extra: Any) -> bytes:
        """The body for the replica: the client's own bytes with the fields the gateway set
        (and `extra`) appended, so a long prompt is never re-encoded. A later duplicate key
        wins in Python's json (the replica's parser), as it does in most. A body that is
        not plain UTF-8 (JSON also parses from UTF-16 and UTF-32) is encoded anew."""
        changes = {**self.changed, **extra}
        if not changes:
            return self.raw
        head = self.raw.rstrip()
        if not (head.endswith(b"}") and self.raw.lstrip().startswith(b"{")) or b"\x00" in head:
            return json.dumps({**self.body, **extra}).encode()
        head = head[:-1].rstrip()
        separator = b"" if head.endswith(b"{") else b","
        return head + separator + json.dumps(changes).encode()[1:]

    def routing_request(self, estimated_output_tokens: int, cache_namespace: str) -> RoutingRequest:
        return RoutingRequest(
            prompt_tokens=self.input_tokens,
            num_sequences=self.num_sequences,
            max_tokens=self.max_tokens,
            estimated_output_tokens=estimated_output_tokens,
            user=self.user,
            session_id=self.session_id,
            prefix_text=self.prefix_text,
            cache_namespace=cache_namespace,
        )

    @property
    def sticky_key(self) -> str | None:
        """What keeps a conversation on one side of a canary split: the session, else the
        conversation's first message (the same for all its turns)."""
        if self.session_id:
            return f"session:{self.session_id}"
        if self.user:
            return f"user:{self.user}"
        return self.prefix_text[:256] or None


def parse_request(
    raw: bytes, path: str, session_id: str | None, limits: RequestLimitsConfig
) -> ParsedRequest:
    try:
        body = json.loads(raw)
    # ValueError: not JSON, not UTF-8, or an integer past Python's 4300-digit limit.
    except (ValueError, RecursionError):
        raise GatewayError(400, "We could not parse the JSON body of your request.") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "The request body must be a JSON object.")
    for name in FAILOVER_FIELDS:
        if name in body:
            raise GatewayError(400, f"{name}: set only by the gateway's failover, never by a "
                               "client", param=name, code="unsupported_parameter")  # fmt: skip
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "model: a model name is required.")
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise GatewayError(400, "messages: a list of message objects is required.")
        prefix_text = chat_prefix_text(messages)
        prompt = Prompt(prefix_text, estimate_num_tokens(prefix_text), 1, is_exact=False)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    elif path.endswith("/embeddings"):
        prompt = read_prompt(body.get("input"), limits, field="input")
        max_tokens = None
    else:
        prompt = read_prompt(body.get("prompt"), limits)
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise GatewayError(400, "max_tokens: must be a positive integer.")
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise GatewayError(400, "stream: must be true or false.")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= limits.max_n:
        raise GatewayError(400, f"n: must be an integer from 1 to {limits.max_n}.")
    # a completion's `best_of` candidates all run (the replica returns the best `n`)
    best_of = body.get("best_of") if not path.endswith("/chat/completions") else None
    if best_of is not None and (not _is_int(best_of) or not n <= best_of <= limits.max_n):
        raise GatewayError(400, f"best_of: must be an integer from n to {limits.max_n}.",
                           param="best_of")  # fmt: skip
    check_stop(body.get("stop"), limits)
    user = body.get("user")
    return ParsedRequest(
        body=body,
        model=model,
        stream=bool(stream),
        max_tokens=max_tokens,
        input_tokens=prompt.num_tokens,
        input_is_exact=prompt.is_exact,
        prefix_text=prompt.prefix_text,
        user=user if isinstance(user, str) else None,
        session_id=session_id,
        num_sequences=(best_of or n) * prompt.num_prompts,
        raw=raw,
    )


def requested_tier(headers: Mapping[str, str], served: Sequence[str]) -> str | None:
    """The tier the client named (`x-modelship-tier`), one of `served`; None: not named."""
    name = headers.get(TIER_HEADER)
    if name is not None and name not in served:
        raise GatewayError(400, f"{TIER_HEADER}: no tier is named so; served: {', '.join(served)}",
                           param=TIER_HEADER, code="unknown_tier")  # fmt: skip
    return name


def check_stop(stop: object, limits: RequestLimitsConfig) -> None:
    """`stop`: absent, one string, or at most `max_stop` strings of at most
    `max_stop_chars` characters each (every stop string is matched at every step)."""
    if stop is None:
        return
    strings = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(strings, list)
        or len(strings) > limits.max_stop
        or not all(isinstance(s, str) and len(s) <= limits.max_stop_chars for s in strings)
    ):
        raise GatewayError(
            400,
            f"stop: a string or a list of at most {limits.max_stop} strings of at most "
            f"{limits.max_stop_chars} characters is required.",
        )


@dataclass(frozen=True)
class Prompt:
    """A completion's `prompt` as the gateway prices and routes it: `num_tokens` exact for
    token ids, estimated for text; `prefix_text` the text that prefix affinity hashes."""

    prefix_text: str
    num_tokens: int
    num_prompts: int
    is_exact: bool  # token ids, counted


def read_prompt(prompt: object, limits: RequestLimitsConfig, field: str = "prompt") -> Prompt:
    """A string, a list of strings, a list of token ids, or a list of such lists (the
    forms the OpenAI API takes); anything else is a 400. Token ids render as
    `"id,id,...,"`, so a prompt extending another one renders as an extension of it.
    Lengths are checked before any item is: more than `max_prompts` prompts, or a token-id
    list longer than `max_prompt_tokens`, is a 400 (4 million ids once cost the gateway
    seconds here, and a replica more, before its length check)."""
    if isinstance(prompt, str):
        return Prompt(prompt, estimate_num_tokens(prompt), 1, is_exact=False)
    if isinstance(prompt, list) and prompt:
        check_prompt_lengths(prompt, limits, field)
        if all(_is_int(t) for t in prompt):
            return Prompt(_token_text(prompt), len(prompt), 1, is_exact=True)
        if all(isinstance(p, str) for p in prompt):
            text = "".join(prompt)
            num_tokens = sum(estimate_num_tokens(p) for p in prompt)
            return Prompt(text, num_tokens, len(prompt), is_exact=False)
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            text = "".join(_token_text(p) for p in prompt)
            return Prompt(text, sum(len(p) for p in prompt), len(prompt), is_exact=True)
    raise GatewayError(
        400,
        f"{field}: a string, a list of strings, a list of token ids or a list of token id "
        "lists is required.",
    )


def check_prompt_lengths(prompt: list, limits: RequestLimitsConfig, field: str = "prompt") -> None:
    """A list of prompts at most `max_prompts` long, token-id lists at most
    `max_prompt_tokens` (unset: unbounded here, the replicas refuse them)."""
    exceeded = exceeded_bound(prompt, limits.max_prompts, limits.max_prompt_tokens)
    if exceeded is PromptBound.PROMPTS:
        raise GatewayError(400, f"{field}: at most {limits.max_prompts} prompts per request.",
                           param=field)  # fmt: skip
    if exceeded is PromptBound.TOKEN_IDS:
        raise GatewayError(
            400,
            f"{field}: a prompt takes at most {limits.max_prompt_tokens} token ids (the served "
            "model's context length).",
            code="context_length_exceeded",
            param=field,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_text(token_ids: list[int]) -> str:
    return "".join(f"{t}," for t in token_ids)
