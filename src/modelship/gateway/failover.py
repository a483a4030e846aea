"""Mid-stream failover: a stream whose replica dies goes on from another replica.

A stream eligible for failover (one sequence, no echo) asks its replica for the token ids
of every event (the `return_token_ids` extension). `StreamProgress` reads the events on
their way to the client and keeps those ids. When the replica's connection breaks (or it
falls silent) before the stream finished, the gateway sends the same request again to
another replica with `resume_token_ids`: the replica appends them to the prompt as output
already generated (its detokenizer sees them as output, so text and stop strings run on
across the cut), generates only what is left of `max_tokens`, and counts usage as one
uninterrupted stream would. The client's stream goes on under the first replica's chunk
id; a greedy (temperature 0) stream is the same text, a sampled one a valid continuation.
Token ids, never text, cross the cut: re-tokenizing text could pick different tokens.
At most `resilience.max_failovers` replicas are tried per stream; then the stream ends
with an error event, as a stream without failover does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class FailoverOutcome(StrEnum):
    RESUMED = "resumed"  # another replica took the stream over
    EXHAUSTED = "exhausted"  # no replica could resume it within `max_failovers`


def can_fail_over(body: dict[str, Any], num_sequences: int) -> bool:
    """One sequence and no echo: a continuation is then one prompt plus its output so far."""
    return num_sequences == 1 and not body.get("echo")


@dataclass
class StreamProgress:
    """What a stream has delivered to its client, read from whole SSE events."""

    # The client asked for `token_ids` itself (a direct caller: the gateway refuses that
    # field from clients); else the gateway did, for this failover, and they are taken out
    # of the events the client gets.
    pass_token_ids: bool = False
    token_ids: list[int] = field(default_factory=list)
    is_finished: bool = False  # the choice's finish_reason went out
    stream_id: bytes | None = None  # the first replica's chunk id, kept for the whole stream
    _rewrite: tuple[bytes, bytes] | None = None  # (a resuming replica's id, stream_id)
    _resuming: bool = False

    def read(self, events: bytes) -> bytes:
        """Account for whole events; returns them as the client gets them (a resuming
        replica's chunk id replaced with the stream's, `token_ids` taken out unless the
        client asked for them)."""
        if self._rewrite is None and not self._resuming and self.pass_token_ids:
            for event in events.split(b"\n\n"):
                self._read(event)
            return events
        out = []
        for event in events.split(b"\n\n"):
            chunk_id, event = self._read(event)
            if self._resuming and chunk_id is not None:
                self._resuming = False
                if self.stream_id is not None and chunk_id != self.stream_id:
                    self._rewrite = (chunk_id, self.stream_id)
            if self._rewrite is not None:
                event = event.replace(*self._rewrite, 1)
            out.append(event)
        return b"\n\n".join(out)

    def resume(self) -> None:
        """The next events come from another replica."""
        self._resuming = True
        self._rewrite = None

    def _read(self, event: bytes) -> tuple[bytes | None, bytes]:
        """The chunk id of a data event (None for anything else), and the event as the
        client gets it."""
        if not event.startswith(b"data:"):
            return None, event
        payload = event[5:].strip()
        if payload == b"[DONE]":
            return None, event
        try:
            chunk = json.loads(payload)
        except (ValueError, RecursionError):
            return None, event
        if not isinstance(chunk, dict):
            return None, event
        chunk_id = chunk.get("id")
        chunk_id = chunk_id.encode() if isinstance(chunk_id, str) else None
        if self.stream_id is None:
            self.stream_id = chunk_id
        removed = False
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.token_ids += [t for t in ids if isinstance(t, int)]
            if not self.pass_token_ids and "token_ids" in choice:
                del choice["token_ids"]
                removed = True
            if choice.get("finish_reason") is not None:
                self.is_finished = True
        if removed:
            event = b"data: " + json.dumps(chunk).encode()
        return chunk_id, event
