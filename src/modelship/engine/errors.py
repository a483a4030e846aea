"""Typed engine errors; the server maps them to HTTP statuses (never by message text)."""

from __future__ import annotations


class EngineOverloadedError(Exception):
    """The waiting queue is full (by requests or tokens); maps to 429 with Retry-After."""

    def __init__(self, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(f"engine overloaded: {reason}")
        self.reason = reason
        self.retry_after_s = retry_after_s


class RequestTooLongError(ValueError):
    """The request can never fit (context length or the whole KV pool); maps to 400."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (an unexpected error, or shutdown): every open request
    fails with it and new ones are refused at once; the server answers 503 and reports
    itself not ready and unhealthy, so a supervisor restarts the replica."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine step (its sequences were aborted, the others
    went on); maps to 500."""


class KVCacheTooSmallError(ValueError):
    """At start-up: the KV cache cannot hold one sequence of `max_model_len` tokens."""
