"""What a routing policy sees: endpoints, the request, and the decision it returns.

The gateway owns these values and keeps them current (its own in-flight counts, the load
scraped from each replica's /metrics, health from /ready and the circuit breakers); a
router only reads them. "Request" here is one client HTTP request, whatever number of
sequences it asks the engine for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class NoEndpointError(Exception):
    """No routable endpoint exists (none configured, or all unhealthy/ejected/open)."""


class Reason(StrEnum):
    """Why a router chose its endpoint; a small fixed set, so it can be a metric label."""

    ROUND_ROBIN = "round_robin"
    LEAST_TOKENS = "least_tokens"
    AFFINITY_HIT = "affinity_hit"  # the request extends a prefix seen on this endpoint
    AFFINITY_NEW = "affinity_new"  # continues no tracked prompt: the least loaded endpoint
    SESSION_HIT = "session_hit"
    SESSION_NEW = "session_new"
    LOAD_BOUND = "load_bound"  # the preferred endpoint was over the load bound
    FALLBACK = "fallback"  # nothing to hash (no session key, prompt under one block)


@dataclass(eq=False)
class Endpoint:
    """One replica as the gateway sees it (compared and hashed by identity: it is a live
    record the gateway updates, not a value).

    `in_flight` and `outstanding_tokens` are the gateway's own bookkeeping (exact, updated
    synchronously); `num_requests_running`/`num_requests_waiting` are scraped from the
    replica (None until the first scrape) and also count requests sent by other gateways.
    """

    endpoint_id: str
    url: str = ""
    in_flight: int = 0
    outstanding_tokens: int = 0
    num_requests_running: int | None = None
    num_requests_waiting: int | None = None
    is_routable: bool = True
    release: str | None = None

    def add_request(self, num_tokens: int) -> None:
        """Count a request the gateway has just sent here (`RoutingRequest.num_tokens`)."""
        self.in_flight += 1
        self.outstanding_tokens += num_tokens

    def remove_request(self, num_tokens: int) -> None:
        """Undo `add_request` with the same `num_tokens` when the request ends, however."""
        self.in_flight = max(0, self.in_flight - 1)
        self.outstanding_tokens = max(0, self.outstanding_tokens - num_tokens)

    @property
    def num_unseen_requests(self) -> int:
        """Requests the replica reports beyond the ones this gateway has in flight there."""
        if self.num_requests_running is None or self.num_requests_waiting is None:
            return 0
        return max(0, self.num_requests_running + self.num_requests_waiting - self.in_flight)


@dataclass(frozen=True)
class RoutingRequest:
    """The parts of a request that routing looks at.

    `prefix_text` is what prefix affinity hashes: for chat, the whole rendered history
    (`chat_prefix_text`), so conversations sharing only a system prompt can spread out
    while the later turns of one conversation find the replica holding its cache.
    `estimated_output_tokens` comes from an `OutputLengthEstimator`; None means the
    worst case, `max_tokens`. Each of the `num_sequences` (`n` per prompt) generates its
    own output.
    """

    prompt_tokens: int
    max_tokens: int | None = None
    estimated_output_tokens: int | None = None
    user: str | None = None
    session_id: str | None = None  # the x-session-id header
    prefix_text: str = ""
    num_sequences: int = 1
    # The tenant's prefix-cache namespace (its cache salt): what a router remembers of a
    # prompt or session is kept apart per namespace, so one tenant's routing never tells
    # it what another sent (an affinity hit on a guessed prompt would confirm it).
    cache_namespace: str = ""

    @property
    def num_tokens(self) -> int:
        """Prompt plus expected output of every sequence: what the request adds to
        `outstanding_tokens`."""
        output = self.estimated_output_tokens
        if output is None:
            output = self.max_tokens or 0
        return self.prompt_tokens + self.num_sequences * output

    @property
    def session_key(self) -> str | None:
        """The explicit session header wins over the OpenAI `user` field."""
        if self.session_id:
            return f"{self.cache_namespace}\nsession:{self.session_id}"
        if self.user:
            return f"{self.cache_namespace}\nuser:{self.user}"
        return None


@dataclass(frozen=True)
class Decision:
    """The chosen endpoint and, for retries, the other candidates, best first."""

    endpoint: Endpoint
    reason: Reason
    fallbacks: tuple[Endpoint, ...] = field(default=())


class OutputLengthEstimator:
    """A running average of observed output lengths, to price requests before they run.

    Clients often send a large `max_tokens` and stop far earlier; charging the full
    `max_tokens` would make token-aware routing count requests, not work. The estimate is
    `min(max_tokens, average)`, the average an exponential moving one starting at
    `initial_tokens`.
    """

    def __init__(self, initial_tokens: float = 256.0, smoothing: float = 0.05) -> None:
        if initial_tokens < 0:
            raise ValueError("initial_tokens must be >= 0")
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        self.average = float(initial_tokens)
        self.smoothing = smoothing
        self.num_observed = 0

    def observe(self, num_output_tokens: int) -> None:
        """Record the output length of a finished request."""
        if self.num_observed == 0:
            self.average = float(num_output_tokens)  # the first real value beats the guess
        else:
            self.average += self.smoothing * (num_output_tokens - self.average)
        self.num_observed += 1

    def estimate(self, max_tokens: int | None) -> int:
        average = math.ceil(self.average)
        return average if max_tokens is None else min(max_tokens, average)


def estimate_num_tokens(text: str, bytes_per_token: float = 4.0) -> int:
    """A tokenizer-free estimate for routing and admission at the gateway, from the UTF-8
    bytes: a CJK character or an emoji (3 or 4 bytes) is often a token or more, which a
    count of characters missed by 4x or more. Limits on the exact count are the replica's."""
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / bytes_per_token)


def chat_prefix_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """Render chat messages for prefix hashing.

    Each message renders on its own and the renders are concatenated, so the text of
    `messages[:k]` is always a prefix of the text of `messages[:k + 1]`: a conversation's
    next turn extends its previous prompt, as it does in the replica's KV cache.
    """
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(
                str(part.get("text", "")) for part in content if isinstance(part, Mapping)
            )
        parts.append(f"<|{message.get('role', '')}|>\n{content or ''}\n")
    return "".join(parts)
