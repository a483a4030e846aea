"""Routing policies as pure functions over stub endpoints."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest

from modelship.gateway import (
    Endpoint,
    NoEndpointError,
    OutputLengthEstimator,
    Reason,
    RoutingRequest,
    chat_prefix_text,
    create_router,
    supported_routers,
)
from modelship.gateway.routing import (
    LeastOutstandingTokensRouter,
    PrefixAffinityRouter,
    RoundRobinRouter,
    SessionAffinityRouter,
)

SYSTEM = "You are a careful assistant. Answer briefly and cite the manual. " * 4


def make_endpoints(num: int) -> list[Endpoint]:
    return [Endpoint(f"e{i}", f"http://127.0.0.1:{9000 + i}") for i in range(num)]


def send(router, request: RoutingRequest, endpoints: list[Endpoint]):
    """Route and count the request on the chosen endpoint, as the gateway does."""
    decision = router.choose(request, endpoints)
    decision.endpoint.add_request(request.num_tokens)
    return decision


def chat(*turns: str) -> RoutingRequest:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    text = chat_prefix_text(messages)
    return RoutingRequest(prompt_tokens=len(text) // 4, max_tokens=64, prefix_text=text)


# --- common contract -------------------------------------------------------------------


@pytest.mark.parametrize("name", supported_routers())
def test_no_endpoint_raises(name: str) -> None:
    router = create_router(name)
    request = chat("hello there")
    with pytest.raises(NoEndpointError, match="no endpoints"):
        router.choose(request, [])
    down = make_endpoints(2)
    for endpoint in down:
        endpoint.is_routable = False
    with pytest.raises(NoEndpointError, match="none healthy"):
        router.choose(request, down)


@pytest.mark.parametrize("name", supported_routers())
def test_skips_unroutable_and_fallbacks_are_the_other_routable(name: str) -> None:
    router = create_router(name)
    endpoints = make_endpoints(4)
    endpoints[1].is_routable = False
    for i in range(40):
        request = RoutingRequest(prompt_tokens=10, user=f"u{i}", prefix_text=f"{i}" * 300)
        decision = router.choose(request, endpoints)
        assert decision.endpoint is not endpoints[1]
        chosen_and_fallbacks = [decision.endpoint, *decision.fallbacks]
        assert sorted(e.endpoint_id for e in chosen_and_fallbacks) == ["e0", "e2", "e3"]


def test_registry() -> None:
    assert supported_routers() == [
        "least_outstanding_tokens",
        "prefix_affinity",
        "round_robin",
        "session",
    ]
    assert isinstance(create_router("prefix_affinity", block_chars=16), PrefixAffinityRouter)
    with pytest.raises(ValueError, match="supported: round_robin"):
        create_router("random")
    with pytest.raises(ValueError, match="routing policy 'round_robin'"):
        create_router("round_robin", load_factor=2)
    with pytest.raises(ValueError, match="load_factor must be >= 1"):
        create_router("session", load_factor=0.9)


# --- round robin -----------------------------------------------------------------------


def test_round_robin_balances_exactly() -> None:
    router = RoundRobinRouter()
    endpoints = make_endpoints(3)
    decisions = [send(router, RoutingRequest(prompt_tokens=1), endpoints) for _ in range(300)]
    assert [e.in_flight for e in endpoints] == [100, 100, 100]
    assert all(d.reason == Reason.ROUND_ROBIN for d in decisions)
    assert [d.endpoint.endpoint_id for d in decisions[:4]] == ["e0", "e1", "e2", "e0"]
    assert [e.endpoint_id for e in decisions[1].fallbacks] == ["e2", "e0"]


# --- least outstanding tokens ----------------------------------------------------------


def test_least_tokens_picks_least_loaded_and_ranks_fallbacks() -> None:
    router = LeastOutstandingTokensRouter()
    endpoints = make_endpoints(3)
    for endpoint, tokens in zip(endpoints, [500, 100, 300], strict=True):
        endpoint.outstanding_tokens = tokens
    decision = router.choose(RoutingRequest(prompt_tokens=10), endpoints)
    assert decision.endpoint.endpoint_id == "e1"
    assert decision.reason == Reason.LEAST_TOKENS
    assert [e.endpoint_id for e in decision.fallbacks] == ["e2", "e0"]


def test_least_tokens_counts_work_not_requests() -> None:
    """A long request outweighs several short ones when output is estimated, not
    charged at max_tokens."""
    estimator = OutputLengthEstimator()
    for _ in range(20):
        estimator.observe(20)

    def short(estimate: bool) -> RoutingRequest:
        output = estimator.estimate(4000) if estimate else None
        return RoutingRequest(prompt_tokens=50, max_tokens=4000, estimated_output_tokens=output)

    for estimate in (True, False):
        router = LeastOutstandingTokensRouter()
        endpoints = make_endpoints(2)
        long = RoutingRequest(prompt_tokens=3000, max_tokens=200, estimated_output_tokens=200)
        assert send(router, long, endpoints).endpoint is endpoints[0]
        chosen = [send(router, short(estimate), endpoints).endpoint for _ in range(10)]
        if estimate:  # each short one costs 70 tokens: all ten fit beside the long one
            assert all(endpoint is endpoints[1] for endpoint in chosen)
        else:  # each charged 4050 tokens: the second already goes to e0
            assert chosen[1] is endpoints[0]


def test_least_tokens_counts_requests_other_gateways_sent() -> None:
    router = LeastOutstandingTokensRouter()
    endpoints = make_endpoints(2)
    endpoints[0].num_requests_running, endpoints[0].num_requests_waiting = 5, 3
    endpoints[1].outstanding_tokens = 300
    endpoints[1].in_flight = 2
    endpoints[1].num_requests_running, endpoints[1].num_requests_waiting = 2, 0
    decision = router.choose(RoutingRequest(prompt_tokens=100), endpoints)
    assert decision.endpoint is endpoints[1]  # e0: 8 unseen requests x 100 tokens


def test_least_tokens_ties_take_turns() -> None:
    router = LeastOutstandingTokensRouter()
    endpoints = make_endpoints(3)
    chosen = [router.choose(RoutingRequest(prompt_tokens=1), endpoints) for _ in range(3)]
    assert {d.endpoint.endpoint_id for d in chosen} == {"e0", "e1", "e2"}


def test_output_length_estimator() -> None:
    estimator = OutputLengthEstimator(initial_tokens=256, smoothing=0.5)
    assert estimator.estimate(None) == 256
    assert estimator.estimate(100) == 100
    estimator.observe(40)
    assert estimator.estimate(1000) == 40  # the first observation replaces the guess
    estimator.observe(80)
    assert estimator.estimate(1000) == 60
    assert estimator.estimate(10) == 10


def test_request_size_and_session_key() -> None:
    assert RoutingRequest(prompt_tokens=10, max_tokens=50).num_tokens == 60
    assert RoutingRequest(10, max_tokens=50, estimated_output_tokens=7).num_tokens == 17
    assert RoutingRequest(prompt_tokens=10).num_tokens == 10
    # Every sequence (n per prompt) generates its own output; the prompt is read once.
    assert RoutingRequest(10, estimated_output_tokens=7, num_sequences=3).num_tokens == 31
    assert RoutingRequest(1, user="ann", session_id="s1").session_key == "\nsession:s1"
    assert RoutingRequest(1, user="ann").session_key == "\nuser:ann"
    assert RoutingRequest(1).session_key is None
    # Within the tenant's namespace: another tenant's equal session id is another session.
    assert RoutingRequest(1, session_id="s1", cache_namespace="ns").session_key == "ns\nsession:s1"


def test_chat_prefix_text_is_prefix_stable() -> None:
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
        {"role": "assistant", "content": None},
    ]
    for k in range(len(messages)):
        assert chat_prefix_text(messages[k + 1 :]) != chat_prefix_text(messages)
        assert chat_prefix_text(messages).startswith(chat_prefix_text(messages[:k]))
    assert "hi" in chat_prefix_text(messages)


# --- prefix affinity -------------------------------------------------------------------


def test_prefix_same_prompt_same_endpoint() -> None:
    router = PrefixAffinityRouter()
    endpoints = make_endpoints(4)
    request = chat("What does the walrus operator do?")
    first = router.choose(request, endpoints)
    assert first.reason == Reason.AFFINITY_NEW
    for _ in range(5):
        again = router.choose(request, endpoints)
        assert again.endpoint is first.endpoint
        assert again.reason == Reason.AFFINITY_HIT


def test_prefix_memory_is_per_namespace() -> None:
    """Tenant A resending tenant B's prompt is no hit (the reason would confirm a guess at
    B's secret), while B's own next request is."""
    router, endpoints = PrefixAffinityRouter(), make_endpoints(2)
    secret = chat("my account number is 4711")
    first = send(router, dataclasses.replace(secret, cache_namespace="tenant-b"), endpoints)
    assert first.reason is Reason.AFFINITY_NEW
    guess = send(router, dataclasses.replace(secret, cache_namespace="tenant-a"), endpoints)
    assert guess.reason is Reason.AFFINITY_NEW
    again = send(router, dataclasses.replace(secret, cache_namespace="tenant-b"), endpoints)
    assert again.reason is Reason.AFFINITY_HIT and again.endpoint is first.endpoint


def test_session_memory_is_per_namespace() -> None:
    router, endpoints = SessionAffinityRouter(), make_endpoints(3)
    own = RoutingRequest(1, session_id="s1", cache_namespace="tenant-b")
    assert router.choose(own, endpoints).reason is Reason.SESSION_NEW
    other = dataclasses.replace(own, cache_namespace="tenant-a")
    assert router.choose(other, endpoints).reason is Reason.SESSION_NEW
    assert router.choose(own, endpoints).reason is Reason.SESSION_HIT


def test_prefix_whole_history_counts() -> None:
    """Chats sharing a long system prompt but not their history spread out."""
    router = PrefixAffinityRouter(block_chars=32)
    endpoints = make_endpoints(4)
    chosen = {router.choose(chat(f"question {i}: " * 8), endpoints).endpoint for i in range(24)}
    assert len(chosen) >= 3


def test_prefix_conversation_turns_stick() -> None:
    router = PrefixAffinityRouter(block_chars=32)
    endpoints = make_endpoints(4)
    for i in range(20):
        question = f"Tell me about topic number {i}, please."
        first = router.choose(chat(question), endpoints)
        answer = f"Topic {i} is about many interesting things. " * 3
        second = router.choose(chat(question, answer, "Go on."), endpoints)
        third = router.choose(chat(question, answer, "Go on.", answer, "More."), endpoints)
        assert second.endpoint is first.endpoint and third.endpoint is first.endpoint
        assert second.reason == third.reason == Reason.AFFINITY_HIT


def test_prefix_tracking_is_what_keeps_turns_together() -> None:
    """Without the LRU the ring places each turn by its own whole-history hash, so some
    conversations would move: the memory is doing the work in the test above."""
    router = PrefixAffinityRouter(block_chars=32, max_tracked_prefixes=0)
    endpoints = make_endpoints(4)
    moved = 0
    for i in range(20):
        question = f"Tell me about topic number {i}, please."
        first = router.choose(chat(question), endpoints)
        second = router.choose(chat(question, f"Topic {i}. " * 9, "Go on."), endpoints)
        moved += second.endpoint is not first.endpoint
    assert moved > 0
    assert router.num_tracked_prefixes == 0


def test_prefix_memory_is_bounded() -> None:
    router = PrefixAffinityRouter(block_chars=8, max_tracked_prefixes=5)
    endpoints = make_endpoints(3)
    for i in range(50):
        router.choose(
            RoutingRequest(prompt_tokens=8, prefix_text=f"prompt {i:04d} " * 4), endpoints
        )
    assert router.num_tracked_prefixes == 5


def test_prefix_short_prompt_falls_back_to_least_loaded() -> None:
    router = PrefixAffinityRouter(block_chars=64)
    endpoints = make_endpoints(3)
    endpoints[0].in_flight, endpoints[1].in_flight = 3, 1
    decision = router.choose(RoutingRequest(prompt_tokens=2, prefix_text="hi"), endpoints)
    assert decision.reason == Reason.FALLBACK
    assert decision.endpoint is endpoints[2]
    assert decision.fallbacks == (endpoints[1], endpoints[0])


def test_prefix_hot_key_respects_load_bound() -> None:
    router = PrefixAffinityRouter(load_factor=1.25)
    endpoints = make_endpoints(4)
    request = chat("the same popular question")
    reasons = Counter()
    for _ in range(40):
        total = sum(e.in_flight for e in endpoints) + 1
        decision = send(router, request, endpoints)
        reasons[decision.reason] += 1
        assert max(e.in_flight for e in endpoints) <= math.ceil(1.25 * total / 4)
    assert reasons[Reason.LOAD_BOUND] > 0
    assert reasons[Reason.AFFINITY_HIT] + reasons[Reason.AFFINITY_NEW] > 0


def test_prefix_unroutable_endpoint_is_replaced() -> None:
    router = PrefixAffinityRouter()
    endpoints = make_endpoints(3)
    request = chat("a question")
    home = router.choose(request, endpoints).endpoint
    home.is_routable = False
    moved = router.choose(request, endpoints)
    assert moved.endpoint is not home
    assert router.choose(request, endpoints).reason == Reason.AFFINITY_HIT  # on its new home


# --- session affinity ------------------------------------------------------------------


def test_session_sticks_and_header_wins_over_user() -> None:
    router = SessionAffinityRouter()
    endpoints = make_endpoints(4)
    first = router.choose(RoutingRequest(1, session_id="abc", user="ann"), endpoints)
    assert first.reason == Reason.SESSION_NEW
    for _ in range(5):
        again = router.choose(RoutingRequest(1, session_id="abc", user="bob"), endpoints)
        assert again.endpoint is first.endpoint and again.reason == Reason.SESSION_HIT
    no_key = router.choose(RoutingRequest(1), endpoints)
    assert no_key.reason == Reason.FALLBACK


def test_sessions_spread_and_survive_a_new_endpoint() -> None:
    router = SessionAffinityRouter()
    endpoints = make_endpoints(4)
    homes = {
        f"u{i}": router.choose(RoutingRequest(1, user=f"u{i}"), endpoints).endpoint
        for i in range(60)
    }
    assert len(set(homes.values())) == 4
    endpoints.append(Endpoint("e4"))
    for user, home in homes.items():
        decision = router.choose(RoutingRequest(1, user=user), endpoints)
        assert decision.endpoint is home and decision.reason == Reason.SESSION_HIT
    fresh = SessionAffinityRouter()  # no memory: the ring alone still moves few sessions
    moved = sum(
        fresh.choose(RoutingRequest(1, user=u), endpoints).endpoint is not h
        for u, h in homes.items()
    )
    assert moved <= 60 * 2 / 5


def test_session_moves_only_when_over_the_bound() -> None:
    router = SessionAffinityRouter(load_factor=1.25)
    endpoints = make_endpoints(2)
    home = send(router, RoutingRequest(1, user="ann"), endpoints).endpoint
    # ann's second request: 2 in flight over 2 endpoints -> bound ceil(1.25) = 2: stays.
    assert send(router, RoutingRequest(1, user="ann"), endpoints).endpoint is home
    # third: bound ceil(1.25 * 3 / 2) = 2 and home already holds 2: moves.
    moved = send(router, RoutingRequest(1, user="ann"), endpoints)
    assert moved.endpoint is not home and moved.reason == Reason.LOAD_BOUND
    assert moved.fallbacks == (home,)


def test_session_memory_is_bounded() -> None:
    router = SessionAffinityRouter(max_sessions=10)
    endpoints = make_endpoints(2)
    for i in range(100):
        router.choose(RoutingRequest(1, session_id=str(i)), endpoints)
    assert router.num_sessions == 10
