"""Routing policies behind one interface, and the registry that builds them by name.

Every policy is synchronous and pure apart from its own small, bounded memory (a
round-robin counter, an LRU of recent prefixes or sessions): it reads the endpoints and
never changes them. The gateway counts the request on the chosen endpoint
(`Endpoint.add_request(request.num_tokens)`) right after `choose` returns, before any
await, so the next decision sees it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from modelship.gateway.endpoint import (
    Decision,
    Endpoint,
    NoEndpointError,
    Reason,
    RoutingRequest,
)
from modelship.gateway.hash_ring import HashRing, has_room, hash64, load_bound, prefix_block_hashes


class Router(Protocol):
    def choose(self, request: RoutingRequest, endpoints: Sequence[Endpoint]) -> Decision:
        """Pick a routable endpoint for `request`; the fallbacks are the other routable
        endpoints, best first. Raises NoEndpointError when none is routable. Does not
        modify the endpoints."""
        ...


def routable(endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    candidates = [endpoint for endpoint in endpoints if endpoint.is_routable]
    if not candidates:
        raise NoEndpointError(
            f"no routable endpoint ({len(endpoints)} known, none healthy)"
            if endpoints
            else "no endpoints"
        )
    return candidates


class _Rotation:
    """A counter that spreads ties: equal candidates take turns instead of the first
    one in the list taking every request."""

    def __init__(self) -> None:
        self._count = 0

    def offsets(self, num_candidates: int) -> list[int]:
        start = self._count % num_candidates
        self._count += 1
        return [(i - start) % num_candidates for i in range(num_candidates)]


V = TypeVar("V")


class _LRUMap(Generic[V]):
    """A map that forgets the least recently used keys beyond `max_size`."""

    def __init__(self, max_size: int) -> None:
        if max_size < 0:
            raise ValueError("the LRU size must be >= 0")
        self.max_size = max_size
        self._items: OrderedDict[bytes | str, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: bytes | str) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: bytes | str, value: V) -> None:
        if self.max_size == 0:
            return
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)


def _least_loaded(candidates: list[Endpoint], rotation: _Rotation) -> list[Endpoint]:
    offsets = rotation.offsets(len(candidates))
    ranked = sorted(
        range(len(candidates)),
        key=lambda i: (candidates[i].in_flight, candidates[i].outstanding_tokens, offsets[i]),
    )
    return [candidates[i] for i in ranked]


def _bounded_choice(order: list[Endpoint], bound: int, first_reason: Reason) -> Decision:
    """The first endpoint of `order` with room under `bound`; the endpoints with room
    come next among the fallbacks, the full ones last."""
    with_room = [endpoint for endpoint in order if has_room(endpoint, bound)]
    full = [endpoint for endpoint in order if not has_room(endpoint, bound)]
    # load_factor >= 1 guarantees room: the least loaded endpoint is at most the average.
    chosen = with_room[0]
    reason = first_reason if chosen is order[0] else Reason.LOAD_BOUND
    return Decision(chosen, reason, tuple(with_room[1:] + full))


def _check_load_factor(load_factor: float) -> None:
    if load_factor < 1:
        raise ValueError(
            f"load_factor must be >= 1 (some endpoint must have room), got {load_factor}"
        )


class RoundRobinRouter:
    """Each routable endpoint in turn, ignoring load."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RoutingRequest, endpoints: Sequence[Endpoint]) -> Decision:
        candidates = routable(endpoints)
        i = self._next % len(candidates)
        self._next += 1
        rest = candidates[i + 1 :] + candidates[:i]
        return Decision(candidates[i], Reason.ROUND_ROBIN, tuple(rest))


class LeastOutstandingTokensRouter:
    """The endpoint with the least work pending, counted in tokens, not requests.

    Work is the gateway's outstanding tokens (prompt plus expected output of each request
    in flight there) plus, for requests the replica reports that this gateway did not send
    (other gateways, or a scrape ahead of our count), this request's size as the price of
    each. Ties go to fewer requests in flight, then take turns.
    """

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def score(self, endpoint: Endpoint, request: RoutingRequest) -> int:
        return endpoint.outstanding_tokens + endpoint.num_unseen_requests * request.num_tokens

    def choose(self, request: RoutingRequest, endpoints: Sequence[Endpoint]) -> Decision:
        candidates = routable(endpoints)
        offsets = self._rotation.offsets(len(candidates))
        ranked = sorted(
            range(len(candidates)),
            key=lambda i: (
                self.score(candidates[i], request),
                candidates[i].in_flight,
                offsets[i],
            ),
        )
        order = [candidates[i] for i in ranked]
        return Decision(order[0], Reason.LEAST_TOKENS, tuple(order[1:]))


def _prompt_key(block_hash: bytes, tail: str) -> bytes:
    """A prompt's identity: its chained full blocks and the partial block after them."""
    return hashlib.blake2b(block_hash + tail.encode(), digest_size=16).digest()


class PrefixAffinityRouter:
    """Send a conversation's turns where its history is already cached.

    The prompt's first `block_chars * max_blocks` characters (its window) are hashed in
    chained full blocks of `block_chars`. A request whose window continues the window of
    an earlier request (a conversation's next turn resends its history) goes where that
    request went, its home: an affinity hit. Continuing means the earlier window's full
    blocks lead this one's and its partial last block follows them here too, so prompts
    sharing only a system prompt are no hit, even where a first message as short as "hi"
    leaves all of a prompt's full blocks inside the system prompt. Any other prompt has
    nothing cached anywhere but what all prompts share, so it goes to the least loaded
    endpoint (fewest requests in flight, then fewest outstanding tokens), the
    consistent-hash ring of its hashed blocks breaking ties so that at equal loads every
    gateway places a prompt alike. Placing new conversations by load is what keeps the
    fleet balanced, as each stays where it started.

    The strict bounded-load rule (`load_bound(strict=True)`) caps every endpoint at
    `load_factor` x the average in flight, rounded down (never below the average rounded
    up): a home over it loses the request to the least loaded endpoint, where the
    conversation is tracked from then on. Memory: an LRU of `max_tracked_prefixes` prompts;
    0 leaves every prompt to load and the ring.

    Prompts are hashed within the request's `cache_namespace` (the tenant's cache salt,
    which the replicas' prefix caches are keyed by too): another tenant's prompt is never
    a hit, so a tenant cannot confirm a guess at what another sent by the reason counted.
    """

    def __init__(
        self,
        block_chars: int = 64,
        max_blocks: int = 128,
        load_factor: float = 1.25,
        virtual_nodes: int = 100,
        max_tracked_prefixes: int = 10_000,
    ) -> None:
        if block_chars < 1 or max_blocks < 1:
            raise ValueError("block_chars and max_blocks must be at least 1")
        _check_load_factor(load_factor)
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.load_factor = load_factor
        self._ring = HashRing(virtual_nodes)
        # A tracked prompt's key -> its endpoint id; and the hash of its full blocks -> the
        # lengths of the partial blocks that followed them (fewer than block_chars).
        self._prompts: _LRUMap[str] = _LRUMap(max_tracked_prefixes)
        self._tail_lengths: _LRUMap[set[int]] = _LRUMap(max_tracked_prefixes)
        self._rotation = _Rotation()

    @property
    def num_tracked_prefixes(self) -> int:
        return len(self._prompts)

    def choose(self, request: RoutingRequest, endpoints: Sequence[Endpoint]) -> Decision:
        candidates = routable(endpoints)
        window = request.prefix_text[: self.block_chars * self.max_blocks]
        hashes = prefix_block_hashes(
            window, self.block_chars, self.max_blocks, request.cache_namespace
        )
        if not hashes:  # under one block: nothing a replica could have cached
            order = _least_loaded(candidates, self._rotation)
            return Decision(order[0], Reason.FALLBACK, tuple(order[1:]))
        # A stable sort: the ring's order among equally loaded endpoints survives.
        by_load = sorted(
            self._ring.order(hash64(hashes[-1]), candidates),
            key=lambda endpoint: (endpoint.in_flight, endpoint.outstanding_tokens),
        )
        home = self._find_home(window, hashes, candidates)
        if home is None:
            order, first_reason = by_load, Reason.AFFINITY_NEW
        else:
            order = [home] + [endpoint for endpoint in by_load if endpoint is not home]
            first_reason = Reason.AFFINITY_HIT
        bound = load_bound(candidates, self.load_factor, strict=True)
        decision = _bounded_choice(order, bound, first_reason)
        if self._prompts.max_size > 0:
            tail = window[len(hashes) * self.block_chars :]
            self._prompts.put(_prompt_key(hashes[-1], tail), decision.endpoint.endpoint_id)
            lengths = self._tail_lengths.get(hashes[-1]) or set()
            lengths.add(len(tail))
            self._tail_lengths.put(hashes[-1], lengths)
        return decision

    def _find_home(
        self, window: str, hashes: list[bytes], candidates: list[Endpoint]
    ) -> Endpoint | None:
        """The routable endpoint of the longest tracked prompt that `window` starts with."""
        by_id = {endpoint.endpoint_id: endpoint for endpoint in candidates}
        for num_blocks in range(len(hashes), 0, -1):
            block_hash = hashes[num_blocks - 1]
            start = num_blocks * self.block_chars
            for tail_length in sorted(self._tail_lengths.get(block_hash) or (), reverse=True):
                if start + tail_length > len(window):
                    continue
                tail = window[start : start + tail_length]
                endpoint_id = self._prompts.get(_prompt_key(block_hash, tail))
                if endpoint_id in by_id:
                    return by_id[endpoint_id]
        return None


class SessionAffinityRouter:
    """Keep a session (the x-session-id header, else the `user` field) on one replica.

    A new session is placed on the consistent-hash ring by its key; a known one returns to
    the endpoint it last used (an LRU of `max_sessions`), so it stays put when endpoints
    join. The bounded-load rule moves a session only when its endpoint is full. Requests
    without a session key go to the least loaded endpoint.
    Session keys are kept per `cache_namespace`, like prompts.
    """

    def __init__(
        self, load_factor: float = 1.25, virtual_nodes: int = 100, max_sessions: int = 100_000
    ) -> None:
        _check_load_factor(load_factor)
        self.load_factor = load_factor
        self._ring = HashRing(virtual_nodes)
        self._sessions: _LRUMap[str] = _LRUMap(max_sessions)
        self._rotation = _Rotation()

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def choose(self, request: RoutingRequest, endpoints: Sequence[Endpoint]) -> Decision:
        candidates = routable(endpoints)
        key = request.session_key
        if key is None:
            order = _least_loaded(candidates, self._rotation)
            return Decision(order[0], Reason.FALLBACK, tuple(order[1:]))
        ring_order = self._ring.order(hash64(key.encode()), candidates)
        known_id = self._sessions.get(key)
        known = next((e for e in candidates if e.endpoint_id == known_id), None)
        if known is None:
            order, first_reason = ring_order, Reason.SESSION_NEW
        else:
            order = [known] + [endpoint for endpoint in ring_order if endpoint is not known]
            first_reason = Reason.SESSION_HIT
        decision = _bounded_choice(order, load_bound(candidates, self.load_factor), first_reason)
        self._sessions.put(key, decision.endpoint.endpoint_id)
        return decision


_ROUTERS: dict[str, Callable[..., Router]] = {
    "round_robin": RoundRobinRouter,
    "least_outstanding_tokens": LeastOutstandingTokensRouter,
    "prefix_affinity": PrefixAffinityRouter,
    "session": SessionAffinityRouter,
}


def supported_routers() -> list[str]:
    return sorted(_ROUTERS)


def create_router(name: str, **options: object) -> Router:
    """Build the policy `name` with its keyword options (see each class)."""
    if name not in _ROUTERS:
        raise ValueError(f"unknown routing policy {name!r}; supported: {', '.join(_ROUTERS)}")
    try:
        return _ROUTERS[name](**options)
    except TypeError as exc:
        raise ValueError(f"routing policy {name!r}: {exc}") from None
