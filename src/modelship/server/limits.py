"""Caps on what one API request may ask for, checked before anything reaches the engine.

`n` and the prompts of a completion request multiply its sequences and stop strings are
matched against every new token, so all are bounded per replica. With the defaults a
request's most sequences (64 prompts of n = 16) fill the engine's default waiting queue
(1024) exactly: a request within the caps is never refused as overload by an idle replica
(past the queue it would be a 429 that no retry could ever pass). The gateway checks the same caps
(`gateway.request_limits`); a replica enforces them on its own for direct clients.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelship.server import protocol as p
from modelship.server.errors import BadRequestError


@dataclass(frozen=True)
class RequestLimitsConfig:
    max_n: int = 16  # completions per prompt
    max_stop: int = 16  # stop strings per request, and stop token ids per request
    max_stop_chars: int = 256  # characters per stop string
    max_prompts: int = 64  # prompts per completion request (each runs n sequences)
    max_body_mb: int = 16  # request body size, refused with 413 beyond (`body_limit`)

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop", "max_stop_chars", "max_prompts", "max_body_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    def check(self, request: p.ChatCompletionRequest | p.CompletionRequest) -> None:
        """Raise `BadRequestError` naming the first field over its cap."""
        if request.n > self.max_n:
            raise BadRequestError(f"n must be at most {self.max_n}", "n")
        if isinstance(request, p.CompletionRequest) and request.num_prompts > self.max_prompts:
            raise BadRequestError(
                f"prompt takes at most {self.max_prompts} prompts per request", "prompt"
            )
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stop) > self.max_stop:
            raise BadRequestError(f"stop takes at most {self.max_stop} strings", "stop")
        if any(len(s) > self.max_stop_chars for s in stop):
            raise BadRequestError(
                f"each stop string must be at most {self.max_stop_chars} characters", "stop"
            )
        if len(request.stop_token_ids or []) > self.max_stop:
            raise BadRequestError(
                f"stop_token_ids takes at most {self.max_stop} ids", "stop_token_ids"
            )
