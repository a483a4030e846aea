"""Sending one request to replicas: attempts, retries before the first byte, streaming.

An attempt is one replica tried once. An attempt that fails before any byte reached the
client (refused connection, 503, a replica that died before answering) is retried on the
next candidate, after a jittered backoff, up to `max_attempts`. Once the first byte is
out, the response is the client's: a stream that breaks is resumed on another replica
where it can be (`failover.py`), else it ends with an error event.

Only the replica's faults are failures (a 5xx, a broken connection, silence past the read
timeout): a 4xx is the request's own fault and a client hanging up is the client's, so
neither may open a breaker, eject a replica or roll a canary back.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import httpx

from modelship.gateway.failover import StreamProgress
from modelship.gateway.pool import Upstream
from modelship.gateway.request import GatewayError
from modelship.gateway.resilience import Failure, FailureKind
from modelship.gateway.usage import StreamUsage
from modelship.request_id import REQUEST_ID_HEADER

# Response headers passed back to the client (hop-by-hop and length headers are not).
_PASSED_HEADERS = ("content-type", "retry-after", REQUEST_ID_HEADER)


@dataclass
class Attempt:
    """The outcome of sending to one replica. Either `failure` is set (nothing reached the
    client), or `response` is the replica's answer with `first_chunk` read (streams)."""

    upstream: Upstream
    failure: Failure | None = None
    response: httpx.Response | None = None
    first_chunk: bytes = b""
    chunks: AsyncIterator[bytes] | None = None  # the rest of a stream, after first_chunk
    body: bytes = b""
    payload: Any = None  # the decoded body of a non-streaming 200
    ttft_s: float | None = None

    @property
    def status_code(self) -> int:
        return self.response.status_code if self.response is not None else 502

    def passed_headers(self) -> dict[str, str]:
        assert self.response is not None
        return {k: v for k in _PASSED_HEADERS if (v := self.response.headers.get(k))}


def classify(exc: httpx.HTTPError, got_status: bool) -> FailureKind:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return FailureKind.CONNECT
    if isinstance(exc, httpx.TimeoutException):
        return FailureKind.TIMEOUT
    return FailureKind.READ if got_status else FailureKind.DISCONNECT


async def send_attempt(
    transport: httpx.AsyncBaseTransport,
    upstream: Upstream,
    path: str,
    content: bytes,
    headers: dict[str, str],
    stream: bool,
    read_timeout_s: float,
    connect_timeout_s: float,
    started_at: float,
) -> Attempt:
    """POST to one replica. A stream's status and first chunk are read before returning,
    so a replica that fails before its first token is still a retryable failure.
    `read_timeout_s` bounds each wait for bytes: a stream's first token, or a whole
    non-streaming answer (which arrives only once generation ends).

    Sent on the transport, not through a client: a proxy wants none of a client's
    per-request work (its default headers, cookie jar, auth and redirect flows), which
    was over a quarter of httpx's CPU per request."""
    timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
    request = httpx.Request(
        "POST", upstream.url + path, content=content, headers=headers,
        extensions={"timeout": timeout.as_dict()},
    )  # fmt: skip
    attempt = Attempt(upstream)
    response = None
    try:
        response = await transport.handle_async_request(request)
        response.request = request
        attempt.response = response
        if response.status_code == 503:
            attempt.body = await response.aread()  # the client's answer if no retry is left
            attempt.failure = Failure(FailureKind.STATUS, 503)
            return attempt
        if stream:
            if response.status_code == 200:
                attempt.chunks = response.aiter_raw()
                attempt.first_chunk = await anext(attempt.chunks, b"")
            else:
                attempt.body = await response.aread()
        else:
            attempt.body = await response.aread()
        attempt.ttft_s = time.perf_counter() - started_at
        if response.status_code >= 500:
            attempt.failure = Failure(FailureKind.STATUS, response.status_code)
        elif response.status_code == 200 and not _is_answer(attempt, stream):
            # Garbage with a 200: the replica's fault, and nothing reached the client yet.
            attempt.failure = Failure(FailureKind.INVALID)
            await response.aclose()
            attempt.response = None
    except httpx.HTTPError as exc:
        attempt.failure = Failure(classify(exc, got_status=False))
        if response is not None:
            await response.aclose()
        attempt.response = None
    except asyncio.CancelledError:  # abandoned (client gone, deadline, replica hung)
        if response is not None:
            await response.aclose()  # its connection must not go back to the pool
        raise
    return attempt


def _is_answer(attempt: Attempt, stream: bool) -> bool:
    """Whether a 200 looks like an OpenAI answer: a JSON object (its `payload` is kept for
    the caller), or an event stream whose first chunk arrived. A stream's later events
    are not checked here: they go to the client as they come."""
    assert attempt.response is not None
    if stream:
        content_type = attempt.response.headers.get("content-type", "")
        return content_type.startswith("text/event-stream") and bool(attempt.first_chunk)
    try:
        attempt.payload = json.loads(attempt.body)
    except (ValueError, RecursionError):
        return False
    return isinstance(attempt.payload, dict)


def error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": None}}
    return f"data: {json.dumps(body)}\n\n".encode()


class StreamEnd(StrEnum):
    """How a stream ended; only `REPLICA_FAILED` is the replica's fault."""

    COMPLETE = "complete"
    REPLICA_FAILED = "replica_failed"  # the connection broke, or the replica fell silent
    TIMED_OUT = "timed_out"  # the request's own deadline (`request_timeout_s`) passed
    CLIENT_GONE = "client_gone"  # the client hung up: cancelled mid-stream

    @property
    def status_code(self) -> int:
        """The status the request is recorded with (499: client closed the request)."""
        return {"complete": 200, "replica_failed": 502, "timed_out": 504}.get(self, 499)


Resume = Callable[[Attempt, StreamProgress], Awaitable["Attempt | None"]]


async def pump(
    attempt: Attempt,
    deadline: float,
    usage: StreamUsage,
    on_end: Callable[[StreamEnd, Attempt], None],
    resume: Resume | None = None,
) -> AsyncIterator[bytes]:
    """Yield a streaming attempt's events to the client, read by `usage` on the way;
    `on_end(how, attempt)` runs once however the stream ends (finished, replica failed,
    deadline, client gone), with the attempt that served it last. With `resume`, a replica
    failing mid-stream is replaced by the attempt `resume` returns (None: none could);
    the events' `token_ids` (asked for by the gateway, never by a client: it may not send
    `return_token_ids`) are then taken out of what the client gets."""
    assert attempt.response is not None and attempt.chunks is not None
    progress = StreamProgress() if resume is not None else None
    # Anything else that ends the generator (cancelled, or closed at a yield) is the
    # client going away.
    how = StreamEnd.CLIENT_GONE
    try:
        first = usage.feed(attempt.first_chunk)
        yield progress.read(first) if progress is not None else first
        async with asyncio.timeout_at(deadline):
            while True:
                try:
                    async for chunk in attempt.chunks:
                        if passed := usage.feed(chunk):
                            yield progress.read(passed) if progress is not None else passed
                    break
                except httpx.HTTPError:
                    if resume is None or progress is None:
                        raise
                    usage.flush()  # half an event: dropped
                    await attempt.response.aclose()
                    if progress.is_finished:  # its last token went out: close it cleanly
                        how = StreamEnd.REPLICA_FAILED
                        yield b"data: [DONE]\n\n"
                        return
                    resumed = await resume(attempt, progress)
                    if resumed is None:
                        raise
                    attempt = resumed
                    progress.resume()
                    assert attempt.response is not None and attempt.chunks is not None
                    if passed := usage.feed(attempt.first_chunk):
                        yield progress.read(passed)
        how = StreamEnd.COMPLETE
        if rest := usage.flush():
            yield rest
    except (httpx.HTTPError, TimeoutError) as exc:
        timed_out = isinstance(exc, TimeoutError)
        how = StreamEnd.TIMED_OUT if timed_out else StreamEnd.REPLICA_FAILED
        what = "timed out" if isinstance(exc, TimeoutError | httpx.TimeoutException) else "failed"
        usage.flush()  # half an event: dropped
        if resume is not None and not timed_out:
            what += " and no other replica could resume the stream"
        yield error_event(f"the replica {what} during the stream; the response is incomplete")
    finally:
        assert attempt.response is not None
        await attempt.response.aclose()
        on_end(how, attempt)


def raise_for_final(attempt: Attempt) -> None:
    """Turn a failure that cannot be retried any more into the client's error."""
    failure = attempt.failure
    if failure is None or attempt.response is not None:
        return
    if failure.kind is FailureKind.TIMEOUT:
        raise GatewayError(504, "The model did not answer in time.", "timeout", "timeout")
    raise GatewayError(
        502, "No replica could answer the request.", "upstream_error", "upstream_unavailable"
    )
