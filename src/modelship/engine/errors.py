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
