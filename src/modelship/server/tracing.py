"""A replica's spans: the request (continuing the gateway's trace) and the engine's phases.

The engine phases are made after the request finishes, from times the request path
records anyway (arrival, first token, the engine's queue time on the last delta), with
explicit start and end times: no tracing work per token or per engine step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelship.engine import SequenceDelta
from modelship.request_id import REQUEST_ID_HEADER, is_valid_request_id
from modelship.tracing import Tracing, end_span, extract


class TracingMiddleware:
    """One `replica request` span per API request, a child of the incoming `traceparent`
    (a new trace without one), current while the route and its stream run."""

    def __init__(self, app: ASGIApp, tracing: Tracing, model_name: str, variant: str) -> None:
        self.app = app
        self.tracing = tracing
        self.attributes = {"model": model_name, "variant": variant}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get(REQUEST_ID_HEADER, "")  # any client may send one
        span = self.tracing.start_span(
            "replica request",
            extract(headers),
            {**self.attributes, "path": scope["path"],
             "request_id": request_id if is_valid_request_id(request_id) else ""},
            kind=SpanKind.SERVER,
        )  # fmt: skip
        status = 500  # unless a response starts
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                end_span(span, {"status": status}, error=status >= 500)

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                # Ended before the last byte leaves, so the span lies within the caller's
                # (the gateway's attempt ends when that byte arrives).
                end()
            await send(message)

        # Current for this task and the tasks it starts (the streaming response's).
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            await self.app(scope, receive, send_status)
        finally:
            otel_context.detach(token)
            end()


@dataclass
class EngineSpans:
    """Times of one request's way through the engine, turned into three child spans of
    the current (replica request) span when it ends: `engine.queue` (arrival to first
    scheduled step), `engine.prefill` (to the first token), `engine.decode` (to the end).
    Timings are completion 0's; token counts are all completions'."""

    tracing: Tracing
    arrival_ns: int = field(default_factory=time.time_ns)
    first_token_ns: int | None = None
    queue_time_s: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None

    @classmethod
    def start(cls, tracing: Tracing) -> EngineSpans | None:
        """None unless the current request is traced (sampled)."""
        if not tracing.is_enabled or not trace.get_current_span().is_recording():
            return None
        return cls(tracing)

    def observe(self, delta: SequenceDelta) -> None:
        if delta.index == 0 and delta.token_ids and self.first_token_ns is None:
            self.first_token_ns = time.time_ns()
        if delta.finish_reason is not None:
            self.num_prompt_tokens = delta.num_prompt_tokens
            self.num_cached_tokens = delta.num_cached_tokens
            self.num_output_tokens += delta.num_output_tokens
            if delta.index == 0:
                self.finish_reason = delta.finish_reason
                self.queue_time_s = delta.queue_time_s

    def end(self) -> None:
        parent = trace.get_current_span()
        end_ns = time.time_ns()
        first_token_ns = self.first_token_ns or end_ns  # none came (aborted, failed)
        queue_ns = round((self.queue_time_s or 0.0) * 1e9)
        scheduled_ns = min(self.arrival_ns + queue_ns, first_token_ns)
        phases = [
            ("engine.queue", self.arrival_ns, scheduled_ns, {}),
            ("engine.prefill", scheduled_ns, first_token_ns, {
                "prompt_tokens": self.num_prompt_tokens,
                "cached_tokens": self.num_cached_tokens,
            }),
            ("engine.decode", first_token_ns, end_ns, {
                "output_tokens": self.num_output_tokens,
                "finish_reason": self.finish_reason,
            }),
        ]  # fmt: skip
        for name, start_ns, stop_ns, attributes in phases:
            span = self.tracing.start_span(name, parent, start_time_ns=start_ns)
            span.set_attributes({k: v for k, v in attributes.items() if v is not None})
            span.end(end_time=stop_ns)
