"""What a request used, as the replica counted it: the `usage` of its answer.

Tenants are charged from it, not from the gateway's guesses. A non-streaming answer
carries `usage` in its body. For a stream the gateway always asks the replica for the
final usage event (`stream_options.include_usage`), reads it on the way through, and
drops it from the client's stream unless the client asked for it too. A stream that
ends early (replica failure, client gone) has no usage event: its data events, about one
per generated token, are what it is charged for.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def from_payload(cls, payload: Any) -> Usage | None:
        """The `usage` of a response or chunk payload, or None if it has none."""
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if not isinstance(usage, dict):
            return None
        # embeddings' usage has no completion tokens
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
        if not (isinstance(prompt, int) and isinstance(completion, int)):
            return None
        return cls(max(0, prompt), max(0, completion))


def usage_from_body(body: bytes) -> Usage | None:
    try:
        return Usage.from_payload(json.loads(body))
    except (ValueError, RecursionError):
        return None


def ask_for_usage(body: dict[str, Any]) -> bool:
    """Make a streaming request ask the replica for its usage event; returns whether the
    client asked for it itself (else the gateway removes it from the client's stream)."""
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return True  # not ours to fix: the replica answers 400
    client_asked = bool(options and options.get("include_usage") is True)
    body["stream_options"] = {**(options or {}), "include_usage": True}
    return client_asked


class StreamUsage:
    """Follows a replica's SSE stream event by event on its way to the client.

    `feed` returns the bytes to pass on: whole events only (the tail of a chunk that ends
    inside an event waits for the next chunk), without the usage event when the client
    did not ask for it.
    """

    def __init__(self, pass_usage_event: bool) -> None:
        self.pass_usage_event = pass_usage_event
        self.usage: Usage | None = None
        self.num_events = 0  # data events with output, [DONE] and the usage event aside
        self.first_token_at: float | None = None  # perf_counter of the first generated text
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        self._pending = data[end + 2 :]
        passed = [event + b"\n\n" for event in data[:end].split(b"\n\n") if self._read(event)]
        return b"".join(passed)

    def flush(self) -> bytes:
        """What is left of an event the stream never finished."""
        rest, self._pending = self._pending, b""
        return rest

    def _read(self, event: bytes) -> bool:
        """Account for one event; returns whether it goes on to the client."""
        if not event.startswith(b"data:"):
            return True  # a comment, or the blank line of extra separators
        payload = event[5:].strip()
        if payload == b"[DONE]":
            return True
        # Chunks of an answer carry `"usage":null`; only the last one carries numbers.
        if b'"usage"' in payload and b'"usage":null' not in payload:
            try:
                parsed = json.loads(payload)
            except (ValueError, RecursionError):
                parsed = None
            usage = Usage.from_payload(parsed)
            if usage is not None:
                self.usage = usage
                if not parsed.get("choices"):  # the usage event alone
                    return self.pass_usage_event
        self.num_events += 1
        if self.first_token_at is None and _carries_text(payload):
            self.first_token_at = time.perf_counter()
        return True


def _carries_text(payload: bytes) -> bool:
    """Whether a chunk holds generated text (completions' `text`, chat's `content`); a
    chat stream's first chunk may carry only the role. Byte tests, not a JSON parse: this
    runs on the first events of every stream."""
    for key in (b'"text":"', b'"content":"'):
        at = payload.find(key)
        if at >= 0 and payload[at + len(key) : at + len(key) + 1] != b'"':
            return True
    return False
