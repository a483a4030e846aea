"""Consistent hashing with bounded loads: the bound at every step, minimal remapping."""

from __future__ import annotations

import math
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from modelship.gateway import Endpoint, RoutingRequest, create_router
from modelship.gateway.hash_ring import HashRing, hash64, prefix_block_hashes

LOAD_FACTORS = ["1", "1.25", "1.5", "2"]


def exact_bound(load_factor: str, total_with_new: int, num_endpoints: int) -> int:
    """ceil(c * average), computed exactly (no floats) to judge the router's float math."""
    return math.ceil(Fraction(load_factor) * total_with_new / num_endpoints)


def make_request(policy: str, key: int) -> RoutingRequest:
    # Few distinct keys, so some are hot; prompts long enough for several blocks.
    return RoutingRequest(
        prompt_tokens=100, user=f"user-{key}", prefix_text=f"shared prompt {key} " * 30
    )


# Steps: (True, key) is an arrival for `key`; (False, i) finishes the i-th oldest request.
traces = st.lists(st.tuples(st.booleans(), st.integers(0, 7)), min_size=1, max_size=80)


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(["prefix_affinity", "session"]),
    num_endpoints=st.integers(1, 6),
    num_down=st.integers(0, 2),
    load_factor=st.sampled_from(LOAD_FACTORS),
    trace=traces,
)
def test_load_bound_holds_at_every_step(
    policy: str, num_endpoints: int, num_down: int, load_factor: str, trace
) -> None:
    router = create_router(policy, load_factor=float(load_factor), virtual_nodes=20)
    up = [Endpoint(f"up{i}") for i in range(num_endpoints)]
    down = [Endpoint(f"down{i}", is_routable=False) for i in range(num_down)]
    endpoints = down[:1] + up + down[1:]
    in_flight: list[tuple[Endpoint, int]] = []
    only_arrivals = True
    for is_arrival, key in trace:
        if not is_arrival:
            if in_flight:
                endpoint, tokens = in_flight.pop(key % len(in_flight))
                endpoint.remove_request(tokens)
                only_arrivals = False
            continue
        request = make_request(policy, key)
        bound = exact_bound(load_factor, sum(e.in_flight for e in up) + 1, len(up))
        decision = router.choose(request, endpoints)
        decision.endpoint.add_request(request.num_tokens)
        in_flight.append((decision.endpoint, request.num_tokens))
        assert decision.endpoint.is_routable
        assert decision.endpoint.in_flight <= bound
        if only_arrivals:  # with no departures the bound holds for every endpoint at once
            assert max(e.in_flight for e in up) <= bound
        assert all(e.in_flight == 0 for e in down)


def owners(ring: HashRing, keys: list[int], endpoint_ids: list[str]) -> list[str]:
    return [next(ring.walk(key, endpoint_ids)) for key in keys]


KEYS = [hash64(f"key-{i}".encode()) for i in range(4000)]


def test_ring_spreads_keys_evenly() -> None:
    ids = [f"e{i}" for i in range(8)]
    counts = {endpoint_id: 0 for endpoint_id in ids}
    for owner in owners(HashRing(virtual_nodes=100), KEYS, ids):
        counts[owner] += 1
    fair = len(KEYS) / len(ids)
    assert all(0.7 * fair < count < 1.3 * fair for count in counts.values())


def test_removing_an_endpoint_moves_only_its_keys() -> None:
    ids = [f"e{i}" for i in range(10)]
    ring = HashRing(virtual_nodes=100)
    before = owners(ring, KEYS, ids)
    after = owners(ring, KEYS, [i for i in ids if i != "e3"])
    moved = [b for b, a in zip(before, after, strict=True) if a != b]
    assert set(moved) == {"e3"}  # nothing else moved
    assert len(moved) < 0.15 * len(KEYS)


def test_adding_an_endpoint_moves_few_keys_all_to_it() -> None:
    ids = [f"e{i}" for i in range(10)]
    ring = HashRing(virtual_nodes=100)
    before = owners(ring, KEYS, ids)
    after = owners(ring, KEYS, [*ids, "e10"])
    moved_to = [a for b, a in zip(before, after, strict=True) if a != b]
    assert set(moved_to) == {"e10"}
    assert 0.05 * len(KEYS) < len(moved_to) < 0.15 * len(KEYS)


def test_router_remaps_few_prompts_when_an_endpoint_joins() -> None:
    """Through the router, with no prefix memory: the ring alone decides."""
    prompts = [RoutingRequest(10, prefix_text=f"document {i} " * 20) for i in range(600)]
    endpoints = [Endpoint(f"e{i}") for i in range(5)]
    router = create_router("prefix_affinity", max_tracked_prefixes=0)
    before = [router.choose(p, endpoints).endpoint.endpoint_id for p in prompts]
    endpoints.append(Endpoint("e5"))
    after = [router.choose(p, endpoints).endpoint.endpoint_id for p in prompts]
    moved = [a for b, a in zip(before, after, strict=True) if a != b]
    assert set(moved) == {"e5"}
    assert len(moved) < 0.3 * len(prompts)


def test_prefix_block_hashes_are_chained_and_block_aligned() -> None:
    text = "abcdefgh" * 4 + "tail"
    hashes = prefix_block_hashes(text, block_chars=8, max_blocks=10)
    assert len(hashes) == 4  # the partial tail is not hashed
    assert prefix_block_hashes(text[:16], 8, 10) == hashes[:2]
    assert prefix_block_hashes(text, 8, 3) == hashes[:3]
    # Same block content at a different position hashes differently (the chain).
    assert len(set(hashes)) == 4
    assert prefix_block_hashes("x" * 7, 8, 10) == []
