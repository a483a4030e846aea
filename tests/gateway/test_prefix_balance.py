"""prefix_affinity's balance: the strict load bound, new conversations by load, and
conversations that keep their replica while it is within the bound."""

from __future__ import annotations

import math
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from modelship.gateway import Endpoint, Reason, RoutingRequest, chat_prefix_text, create_router
from modelship.gateway.hash_ring import load_bound

SYSTEM = "You are a concise assistant for an inference platform. " * 6
LOAD_FACTORS = ["1", "1.1", "1.15", "1.25", "1.5", "2"]


def strict_bound(load_factor: str, total_with_new: int, num_endpoints: int) -> int:
    """max(ceil(average), floor(c * average)), computed exactly (no floats)."""
    average = Fraction(total_with_new, num_endpoints)
    return max(math.ceil(average), math.floor(Fraction(load_factor) * average))


def turn(conversation: int, num_turns: int) -> RoutingRequest:
    """The prompt of a conversation's turn `num_turns + 1`: the shared system prompt, then
    its own history (answers included), each turn extending the previous one's text."""
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(num_turns + 1):
        messages.append({"role": "user", "content": f"conversation {conversation}, turn {i}?"})
        if i < num_turns:
            messages.append({"role": "assistant", "content": f"answer {i} of {conversation}"})
    text = chat_prefix_text(messages)
    return RoutingRequest(prompt_tokens=len(text) // 4, max_tokens=16, prefix_text=text)


@settings(max_examples=200, deadline=None)
@given(
    in_flight=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    load_factor=st.sampled_from(LOAD_FACTORS),
)
def test_strict_bound_is_exact_and_leaves_room(in_flight: list[int], load_factor: str) -> None:
    endpoints = [Endpoint(f"e{i}", in_flight=n) for i, n in enumerate(in_flight)]
    total = sum(in_flight) + 1
    bound = load_bound(endpoints, float(load_factor), strict=True)
    assert bound == strict_bound(load_factor, total, len(endpoints))
    assert bound <= load_bound(endpoints, float(load_factor))  # never looser than ceil
    assert min(in_flight) + 1 <= bound  # the least loaded endpoint always has room


def test_strict_bound_at_four_endpoints() -> None:
    """At 4 endpoints holding 7 requests, rounding 1.25 x 2 up would allow 3 (1.5x)."""
    endpoints = [Endpoint(f"e{i}", in_flight=n) for i, n in enumerate([2, 2, 2, 1])]
    assert load_bound(endpoints, 1.25) == 3
    assert load_bound(endpoints, 1.25, strict=True) == 2
    endpoints[3].in_flight = 26  # 32 + 1 in flight: 1.25 x 8.25 = 10.3
    assert load_bound(endpoints, 1.25, strict=True) == 10


# Steps: (True, k) sends the next turn of conversation k; (False, i) finishes the i-th
# oldest request in flight.
traces = st.lists(st.tuples(st.booleans(), st.integers(0, 9)), min_size=1, max_size=100)


@settings(max_examples=200, deadline=None)
@given(
    num_endpoints=st.integers(1, 6),
    num_down=st.integers(0, 2),
    load_factor=st.sampled_from(LOAD_FACTORS),
    trace=traces,
)
def test_conversations_keep_their_replica_within_the_bound(
    num_endpoints: int, num_down: int, load_factor: str, trace
) -> None:
    router = create_router("prefix_affinity", load_factor=float(load_factor), block_chars=16)
    up = [Endpoint(f"up{i}") for i in range(num_endpoints)]
    down = [Endpoint(f"down{i}", is_routable=False) for i in range(num_down)]
    endpoints = down[:1] + up + down[1:]
    home: dict[int, Endpoint] = {}  # conversation -> the endpoint of its last turn
    num_turns: dict[int, int] = {}
    in_flight: list[tuple[Endpoint, int]] = []
    only_arrivals = True
    for is_arrival, key in trace:
        if not is_arrival:
            if in_flight:
                endpoint, tokens = in_flight.pop(key % len(in_flight))
                endpoint.remove_request(tokens)
                only_arrivals = False
            continue
        request = turn(key, num_turns.get(key, 0))
        bound = strict_bound(load_factor, sum(e.in_flight for e in up) + 1, len(up))
        least = min(e.in_flight for e in up)
        decision = router.choose(request, endpoints)
        chosen = decision.endpoint
        if key not in home:  # a new conversation: the least loaded endpoint
            assert chosen.in_flight == least
            assert decision.reason == Reason.AFFINITY_NEW
        elif home[key].in_flight + 1 <= bound:  # its home has room: it stays
            assert chosen is home[key]
            assert decision.reason == Reason.AFFINITY_HIT
        else:  # its home is full: it moves to the least loaded endpoint
            assert chosen is not home[key] and chosen.in_flight == least
            assert decision.reason == Reason.LOAD_BOUND
        chosen.add_request(request.num_tokens)
        in_flight.append((chosen, request.num_tokens))
        home[key] = chosen  # a moved conversation is tracked on its new replica
        num_turns[key] = num_turns.get(key, 0) + 1
        assert chosen.is_routable
        assert chosen.in_flight <= bound
        if only_arrivals:  # with no departures the bound holds for every endpoint at once
            assert max(e.in_flight for e in up) <= bound
        assert all(e.in_flight == 0 for e in down)


def test_closed_loop_chat_stays_balanced_and_never_moves() -> None:
    """The routing benchmark's workload, scripted: 24 conversations of 4 turns, 8 at a time
    over 4 endpoints, each turn sent as the previous one finishes. Every endpoint holds
    exactly 2 requests whenever 8 are in flight, and no later turn leaves its replica."""
    router = create_router("prefix_affinity")
    endpoints = [Endpoint(f"e{i}") for i in range(4)]
    waiting = list(range(24))
    running: list[tuple[int, int, Endpoint, int]] = []  # (conversation, turn, endpoint, tokens)
    reasons: list[Reason] = []

    def send(conversation: int, num_turns: int) -> None:
        request = turn(conversation, num_turns)
        decision = router.choose(request, endpoints)
        decision.endpoint.add_request(request.num_tokens)
        running.append((conversation, num_turns, decision.endpoint, request.num_tokens))
        if num_turns > 0:
            reasons.append(decision.reason)

    for _ in range(8):
        send(waiting.pop(0), 0)
    while running:
        if len(running) == 8:
            assert [e.in_flight for e in endpoints] == [2, 2, 2, 2]
        # The oldest request finishes; its conversation goes on, or a new one starts.
        conversation, num_turns, endpoint, tokens = running.pop(0)
        endpoint.remove_request(tokens)
        if num_turns + 1 < 4:
            send(conversation, num_turns + 1)
        elif waiting:
            send(waiting.pop(0), 0)
    assert len(reasons) == 24 * 3
    assert set(reasons) == {Reason.AFFINITY_HIT}


def test_new_conversations_sharing_a_system_prompt_spread_by_load() -> None:
    router = create_router("prefix_affinity")
    endpoints = [Endpoint(f"e{i}") for i in range(4)]
    endpoints[0].in_flight = 3
    endpoints[1].in_flight = 1
    endpoints[2].in_flight = 1
    endpoints[2].outstanding_tokens = 50  # equal requests: fewer tokens wins
    endpoints[3].in_flight = 1
    endpoints[3].outstanding_tokens = 10
    decision = router.choose(turn(0, 0), endpoints)
    assert decision.endpoint is endpoints[1]
    assert decision.reason == Reason.AFFINITY_NEW
    assert decision.fallbacks == (endpoints[3], endpoints[2], endpoints[0])


def test_sharing_only_the_system_prompt_is_no_hit() -> None:
    """A first message as short as "hi" leaves every full block of its prompt inside the
    system prompt all conversations share; the conversations that follow still start on
    the least loaded endpoint, and "hi"'s own next turn still finds its home."""
    router = create_router("prefix_affinity")  # 64-character blocks
    endpoints = [Endpoint(f"e{i}") for i in range(4)]

    def chat(*turns: str) -> RoutingRequest:
        messages = [{"role": "system", "content": SYSTEM}]
        for i, text in enumerate(turns):
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        text = chat_prefix_text(messages)
        return RoutingRequest(prompt_tokens=len(text) // 4, max_tokens=16, prefix_text=text)

    hi = chat("hi")
    system = chat_prefix_text([{"role": "system", "content": SYSTEM}])
    assert len(hi.prefix_text) // 64 * 64 <= len(system)  # its full blocks: system only
    home = router.choose(hi, endpoints).endpoint
    home.add_request(hi.num_tokens)
    for text in ("hello", "hey", "what is a KV cache block?"):
        request = chat(text)
        decision = router.choose(request, endpoints)
        decision.endpoint.add_request(request.num_tokens)
        assert decision.reason == Reason.AFFINITY_NEW
    assert [endpoint.in_flight for endpoint in endpoints] == [1, 1, 1, 1]
    again = router.choose(chat("hi", "Hello! How can I help?", "Tell me about caches."), endpoints)
    assert again.endpoint is home and again.reason == Reason.AFFINITY_HIT


def test_a_conversation_over_the_bound_moves_and_its_next_turns_follow() -> None:
    router = create_router("prefix_affinity", block_chars=16)
    endpoints = [Endpoint(f"e{i}") for i in range(4)]
    first = router.choose(turn(0, 0), endpoints).endpoint
    first.in_flight = 2  # other work: with this turn 3 over 4 endpoints, the bound is 1
    moved = router.choose(turn(0, 1), endpoints)
    assert moved.reason == Reason.LOAD_BOUND and moved.endpoint is not first
    assert moved.fallbacks[-1] is first  # the full one last
    first.in_flight = 0  # the old home is idle again; the history now lives elsewhere
    follow = router.choose(turn(0, 2), endpoints)
    assert follow.endpoint is moved.endpoint and follow.reason == Reason.AFFINITY_HIT
