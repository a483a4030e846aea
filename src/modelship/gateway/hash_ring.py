"""Consistent hashing with bounded loads, and the hash-chained prefix blocks it places.

Each endpoint owns `virtual_nodes` points on a 64-bit ring; a key belongs to the first
point clockwise from its hash. Adding or removing an endpoint moves only the keys of the
arcs it gains or loses (about 1/n of them). The load bound (Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads") keeps hot keys from piling onto
one replica: with the new request counted, no endpoint may hold more than
`ceil(c * average)` requests in flight, and a key whose owner is full walks on clockwise
to the next endpoint that has room. For c >= 1 some endpoint always has room. The strict
bound rounds `c * average` down instead (never below `ceil(average)`, so some endpoint
still has room): in a small fleet rounding up is a whole request over the average, at 4
endpoints holding 8 requests ceil(1.25 * 2) = 3 = 1.5x the average.

Hashes are blake2b, never Python's `hash()`, so every gateway process (and every restart)
places keys identically.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator, Sequence

from modelship.gateway.endpoint import Endpoint


def hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_block_hashes(
    text: str, block_chars: int, max_blocks: int, namespace: str = ""
) -> list[bytes]:
    """Chained hashes of the text's full blocks of `block_chars` characters, at most
    `max_blocks` of them; hash i covers blocks 0..i. A partial last block is left out,
    as the replica's prefix cache only keeps full blocks. The chain starts from
    `namespace` (a tenant's cache salt), as the replica's does: equal text in two
    namespaces shares no hash."""
    num_blocks = min(len(text) // block_chars, max_blocks)
    hashes = []
    parent = namespace.encode()
    for i in range(num_blocks):
        block = text[i * block_chars : (i + 1) * block_chars]
        parent = hashlib.blake2b(parent + block.encode(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


def load_bound(endpoints: Sequence[Endpoint], load_factor: float, *, strict: bool = False) -> int:
    """The most requests any endpoint may hold once the next request is placed:
    `ceil(load_factor * average)`, or with `strict` at most `load_factor * average` unless
    that is under `ceil(average)`. Either way the least loaded endpoint has room."""
    total = sum(endpoint.in_flight for endpoint in endpoints) + 1
    if not strict:
        return math.ceil(load_factor * total / len(endpoints))
    # ceil(average) in integers; the tolerance keeps e.g. 1.15 * 20 (22.999...) at 23.
    at_least = -(-total // len(endpoints))
    return max(at_least, math.floor(load_factor * total / len(endpoints) + 1e-9))


def has_room(endpoint: Endpoint, bound: int) -> bool:
    return endpoint.in_flight + 1 <= bound


class HashRing:
    """The ring over one set of endpoint ids, rebuilt only when that set changes."""

    def __init__(self, virtual_nodes: int = 100) -> None:
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be at least 1")
        self.virtual_nodes = virtual_nodes
        self._members: frozenset[str] = frozenset()
        self._points: list[int] = []  # sorted positions
        self._owners: list[str] = []  # endpoint id at each position

    def _rebuild(self, members: frozenset[str]) -> None:
        points = sorted(
            (hash64(f"{endpoint_id}#{i}".encode()), endpoint_id)
            for endpoint_id in members
            for i in range(self.virtual_nodes)
        )
        self._points = [position for position, _ in points]
        self._owners = [endpoint_id for _, endpoint_id in points]
        self._members = members

    def walk(self, key: int, endpoint_ids: Sequence[str]) -> Iterator[str]:
        """Distinct endpoint ids clockwise from `key`: the owner first, then successors."""
        members = frozenset(endpoint_ids)
        if members != self._members:
            self._rebuild(members)
        if not self._points:
            return
        start = bisect.bisect_left(self._points, key)
        seen: set[str] = set()
        for step in range(len(self._points)):
            owner = self._owners[(start + step) % len(self._points)]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(members):
                    return

    def order(self, key: int, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """`endpoints` in ring order from `key`."""
        by_id = {endpoint.endpoint_id: endpoint for endpoint in endpoints}
        return [by_id[endpoint_id] for endpoint_id in self.walk(key, list(by_id))]
