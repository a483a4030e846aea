"""Which tier a request goes to (`gateway/tiers.py`): rules, brown-out, opt-outs, as
properties over any loads, and the config's checks."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from modelship.gateway.config import GatewayConfig
from modelship.gateway.tenants import Priority, TenantConfig
from modelship.gateway.tiers import (
    PRIMARY,
    BrownoutConfig,
    TierConfig,
    TierLoad,
    TierNeed,
    TierReason,
    TierRule,
    choose_tier,
    lowest_rank,
)

DIGEST = "0" * 64
TIERS = [TierConfig(name="int8", variant="w8"), TierConfig(name="economy", variant="gptq")]
PER_REPLICA = 2.0
BROWNOUT = BrownoutConfig(max_in_flight_per_replica=PER_REPLICA)
SHORT = TierRule(name="short", tier="economy", max_output_tokens=16, priorities=["low"])


def tenant(**fields) -> TenantConfig:
    return TenantConfig(name="t", api_key_sha256=DIGEST, **fields)


loads_strategy = st.fixed_dictionaries(
    {
        name: st.builds(TierLoad, st.integers(0, 3), st.integers(0, 10))
        for name in [PRIMARY, "int8", "economy"]
    }
)
tenants_strategy = st.sampled_from(
    [
        tenant(),
        tenant(allow_degraded=False),
        tenant(min_variant="w8"),
        tenant(min_variant="gptq"),
        tenant(min_variant="fp16"),  # the primary's own variant: never degraded
    ]
)
needs_strategy = st.builds(
    TierNeed,
    st.sampled_from(list(Priority)),
    st.one_of(st.none(), st.integers(1, 64)),
    st.integers(1, 500),
)
rules_strategy = st.sampled_from([[], [SHORT]])


@settings(max_examples=400, deadline=None)
@given(loads=loads_strategy, config=tenants_strategy, need=needs_strategy, rules=rules_strategy)
def test_a_tenant_is_never_sent_below_its_floor(loads, config, need, rules) -> None:
    decision = choose_tier(TIERS, rules, BROWNOUT, need, config, loads)
    rank = {PRIMARY: 0, "int8": 1, "economy": 2}
    assert rank[decision.tier] <= lowest_rank(config, TIERS)
    if not config.allow_degraded or config.min_variant == "fp16":
        assert decision.tier == PRIMARY


@settings(max_examples=400, deadline=None)
@given(loads=loads_strategy, config=tenants_strategy, need=needs_strategy)
def test_brownout_only_when_the_primary_is_full_and_never_for_high_priority(
    loads, config, need
) -> None:
    decision = choose_tier(TIERS, [], BROWNOUT, need, config, loads)
    if decision.tier == PRIMARY:
        return
    assert decision.reason == TierReason.BROWNOUT
    assert need.priority is not Priority.HIGH
    assert not loads[PRIMARY].has_room(PER_REPLICA)
    # ... and to a tier with room, the best such the tenant accepts
    assert loads[decision.tier].has_room(PER_REPLICA)
    better = TIERS[: [t.name for t in TIERS].index(decision.tier)]
    assert not any(loads[t.name].has_room(PER_REPLICA) for t in better)


@settings(max_examples=400, deadline=None)
@given(loads=loads_strategy, need=needs_strategy)
def test_when_the_primary_is_full_a_cheaper_tier_with_room_is_always_used(loads, need) -> None:
    """Brown-out before refusal: a degradable request never queues on a full primary
    while a cheaper tier has room."""
    decision = choose_tier(TIERS, [], BROWNOUT, need, tenant(), loads)
    room = any(loads[t.name].has_room(PER_REPLICA) for t in TIERS)
    if need.priority is not Priority.HIGH and not loads[PRIMARY].has_room(PER_REPLICA) and room:
        assert decision.tier != PRIMARY


@settings(max_examples=300, deadline=None)
@given(
    loads=loads_strategy,
    need=needs_strategy,
    extra=st.integers(1, 10),
)
def test_more_load_on_the_primary_never_takes_a_request_back_from_brownout(
    loads, need, extra
) -> None:
    before = choose_tier(TIERS, [], BROWNOUT, need, tenant(), loads)
    busier = {**loads, PRIMARY: TierLoad(loads[PRIMARY].routable, loads[PRIMARY].in_flight + extra)}
    after = choose_tier(TIERS, [], BROWNOUT, need, tenant(), busier)
    if before.tier != PRIMARY:
        assert after.tier == before.tier


@settings(max_examples=300, deadline=None)
@given(loads=loads_strategy, config=tenants_strategy, need=needs_strategy)
def test_the_chosen_tier_can_take_the_request_unless_none_can(loads, config, need) -> None:
    decision = choose_tier(TIERS, [SHORT], BROWNOUT, need, config, loads)
    if decision.tier != PRIMARY:
        assert loads[decision.tier].routable > 0


def test_rules_in_order_with_their_names_as_reasons() -> None:
    idle = {PRIMARY: TierLoad(1, 0), "int8": TierLoad(1, 0), "economy": TierLoad(1, 0)}
    rules = [SHORT, TierRule(name="big-prompts", tier="int8", max_input_tokens=1000)]
    low_short = TierNeed(Priority.LOW, max_tokens=8, input_tokens=2000)
    assert choose_tier(TIERS, rules, BROWNOUT, low_short, tenant(), idle).reason == "short"
    # no max_tokens: `short` cannot match; a small prompt matches the second rule
    unbounded = TierNeed(Priority.LOW, max_tokens=None, input_tokens=10)
    decision = choose_tier(TIERS, rules, BROWNOUT, unbounded, tenant(), idle)
    assert (decision.tier, decision.reason) == ("int8", "big-prompts")
    # a rule to a tier without a routable replica gives way
    down = {**idle, "economy": TierLoad(0, 0)}
    decision = choose_tier(TIERS, rules, BROWNOUT, low_short, tenant(), down)
    assert (decision.tier, decision.reason) == (PRIMARY, "default")
    # the tenant's floor holds a rule back, and says so
    decision = choose_tier(TIERS, rules, BROWNOUT, low_short, tenant(min_variant="w8"), idle)
    assert (decision.tier, decision.reason) == (PRIMARY, "opted_out")


def test_a_named_tier_is_served_even_to_a_tenant_that_opted_out() -> None:
    loads = {PRIMARY: TierLoad(1, 0), "economy": TierLoad(1, 0)}
    need = TierNeed(Priority.HIGH, None, 10, requested="economy")
    decision = choose_tier(TIERS, [], BROWNOUT, need, tenant(allow_degraded=False), loads)
    assert (decision.tier, decision.reason) == ("economy", "requested")
    gone = {**loads, "economy": TierLoad(0, 0)}  # the rules' tier instead: the primary
    decision = choose_tier(TIERS, [], BROWNOUT, need, tenant(), gone)
    assert (decision.tier, decision.reason) == (PRIMARY, "unavailable")


def test_a_client_may_name_a_cheaper_tier_never_a_dearer_one() -> None:
    """A low-priority request the rules send to `economy` asking for the primary stays on
    `economy` (denied); asking for a cheaper tier than the rules' is granted; a tenant
    listing the primary in `may_request_tiers` gets it."""
    idle = {PRIMARY: TierLoad(1, 0), "int8": TierLoad(1, 0), "economy": TierLoad(1, 0)}
    low_short = TierNeed(Priority.LOW, max_tokens=8, input_tokens=10, requested=PRIMARY)
    decision = choose_tier(TIERS, [SHORT], BROWNOUT, low_short, tenant(), idle)
    assert (decision.tier, decision.reason) == ("economy", "denied")
    allowed = tenant(may_request_tiers=[PRIMARY])
    decision = choose_tier(TIERS, [SHORT], BROWNOUT, low_short, allowed, idle)
    assert (decision.tier, decision.reason) == (PRIMARY, "requested")
    # brown-out's tier binds the same way
    full = {**idle, PRIMARY: TierLoad(1, 5)}
    normal = TierNeed(Priority.NORMAL, None, 10, requested=PRIMARY)
    decision = choose_tier(TIERS, [], BROWNOUT, normal, tenant(), full)
    assert (decision.tier, decision.reason) == ("int8", "denied")
    cheaper = TierNeed(Priority.NORMAL, None, 10, requested="economy")
    decision = choose_tier(TIERS, [], BROWNOUT, cheaper, tenant(), full)
    assert (decision.tier, decision.reason) == ("economy", "requested")
    # a cheaper tier named without a routable replica gives way to the rules' tier
    gone = {**full, "economy": TierLoad(0, 0)}
    decision = choose_tier(TIERS, [], BROWNOUT, cheaper, tenant(), gone)
    assert (decision.tier, decision.reason) == ("int8", "unavailable")


@settings(max_examples=400, deadline=None)
@given(loads=loads_strategy, config=tenants_strategy, need=needs_strategy, rules=rules_strategy,
       requested=st.sampled_from([PRIMARY, "int8", "economy"]))  # fmt: skip
def test_naming_a_tier_never_buys_a_dearer_one(loads, config, need, rules, requested) -> None:
    rank = {PRIMARY: 0, "int8": 1, "economy": 2}
    unnamed = choose_tier(TIERS, rules, BROWNOUT, need, config, loads)
    named = dataclasses.replace(need, requested=requested)
    decision = choose_tier(TIERS, rules, BROWNOUT, named, config, loads)
    assert rank[decision.tier] >= rank[unnamed.tier]


def test_may_request_tiers_must_name_a_served_tier() -> None:
    tiers = [{"name": "economy", "variant": "gptq"}]
    named = {"name": "a", "api_key_sha256": DIGEST, "may_request_tiers": ["primary", "gold"]}
    with pytest.raises(ValidationError, match="may_request_tiers names tier 'gold'"):
        GatewayConfig(tiers=tiers, tenants=[named])
    GatewayConfig(tiers=tiers, tenants=[{**named, "may_request_tiers": ["primary"]}])


def test_brownout_off_or_for_other_priorities_keeps_the_primary() -> None:
    full = {PRIMARY: TierLoad(1, 5), "int8": TierLoad(1, 0), "economy": TierLoad(1, 0)}
    need = TierNeed(Priority.NORMAL, None, 10)
    off = BrownoutConfig(enabled=False, max_in_flight_per_replica=PER_REPLICA)
    assert choose_tier(TIERS, [], off, need, tenant(), full).tier == PRIMARY
    low_only = BrownoutConfig(priorities=["low"], max_in_flight_per_replica=PER_REPLICA)
    assert choose_tier(TIERS, [], low_only, need, tenant(), full).tier == PRIMARY
    assert choose_tier(TIERS, [], BROWNOUT, need, tenant(), full).tier == "int8"
    # no primary replica routable at all (all starting): overloaded, too
    starting = {**full, PRIMARY: TierLoad(0, 0)}
    decision = choose_tier(TIERS, [], BROWNOUT, need, tenant(), starting)
    assert (decision.tier, decision.reason) == ("int8", "brownout")


@pytest.mark.parametrize(
    ("gateway", "message"),
    [
        ({"tier_rules": [{"name": "r", "tier": "economy"}]}, "names tier 'economy'"),
        ({"tiers": [{"name": "a", "variant": "x"}] * 2}, "tier 'a' is configured twice"),
        ({"tiers": [{"name": "stable", "variant": "x"}]}, "reserved"),
        ({"tiers": [{"name": "a", "variant": "x", "min_replicas": 3, "max_replicas": 2}]},
         "min_replicas (3) exceeds max_replicas (2)"),
        ({"tiers": [{"name": "a", "variant": "x"}],
          "tier_rules": [{"name": "brownout", "tier": "a"}]}, "reserved"),
    ],
)  # fmt: skip
def test_bad_tier_config_is_named(gateway: dict, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        GatewayConfig(**gateway)
    assert message in str(info.value)
