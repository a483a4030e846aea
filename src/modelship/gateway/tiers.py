"""Precision tiers: cheaper variants served beside the release, and which one a request gets.

A fleet serves its production release (the `primary` tier) and, with `gateway.tiers`, more
tiers: each one a variant the optimize stage built and select measured (e.g. gptq beside an
fp16 release), run by replicas of its own; or, a model tier, another model served behind the
same gateway (`models:` in pipeline.yaml; smaller or larger), run by that model's replicas
and asked under its name. Tiers are ranked: primary first, then `tiers` in
the order configured, best to cheapest. Which tier serves a request is decided once, before
routing (`choose_tier`, pure), in this order:

1. the first of `tier_rules` the request matches (priority, max_tokens, input size);
2. brown-out: the primary tier is overloaded (its in-flight requests reach
   `brownout.max_in_flight_per_replica` per routable replica, or none is routable) and the
   request's priority is one of `brownout.priorities`: the best cheaper tier with room;
3. else the primary tier.

A tenant with `allow_degraded: false` is never sent below the primary by 1 or 2, and one with
`min_variant` never below the tier serving that variant. A tier chosen with no routable
replica gives way to the primary.

The client may name a tier (`x-modelship-tier`) at or below the one the rules and brown-out
give it (cheaper, never dearer): else a low-priority tenant could name the primary and
escape both. A tier its tenant lists in `may_request_tiers` it may name whatever the rules
say. A tier named and not granted is counted with reason `denied` and the rules' tier
serves; one named without a routable replica gives way to the rules' tier.

The decision's tier and reason are counted (`modelship_gateway_tier_decisions_total`); the
answer names the tier, model and variant that served it (`x-modelship-tier`,
`x-modelship-model`, `x-modelship-variant`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from modelship.gateway.tenants import Priority, TenantConfig

PRIMARY = "primary"
TIER_HEADER = "x-modelship-tier"
_RESERVED = {PRIMARY, "stable", "canary"}  # the track names label the same gauges
PriorityName = Literal["low", "normal", "high"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierConfig(_Section):
    """One more tier: replicas of an optimized variant of the served model (`variant`), or
    another model behind the same gateway (`model`: its served name, one of `models:`)."""

    # A DNS label: it names the tier's Kubernetes objects too.
    name: str = Field(min_length=1, max_length=20, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
    variant: str | None = Field(default=None, min_length=1)  # under models/<slug>/optimized/
    model: str | None = Field(default=None, min_length=1)  # scaled as that model is
    # Kept running however idle: brown-out needs a ready replica the moment load comes.
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _valid(self) -> TierConfig:
        if self.name in _RESERVED:
            raise ValueError(f"tier name {self.name!r} is reserved")
        if (self.variant is None) == (self.model is None):
            raise ValueError(f"tier {self.name}: set one of `variant` and `model`")
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"tier {self.name}: min_replicas ({self.min_replicas}) exceeds max_replicas "
                f"({self.max_replicas})"
            )
        return self


class TierRule(_Section):
    """Requests matching every condition set here go to `tier` (the first rule matching
    wins). `max_output_tokens` matches only requests that set max_tokens at most that."""

    name: str = Field(min_length=1, pattern=r"^[a-z0-9][a-z0-9_-]*$")
    tier: str = Field(min_length=1)
    priorities: list[PriorityName] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    max_input_tokens: int | None = Field(default=None, ge=1)

    def matches(self, need: TierNeed) -> bool:
        if self.priorities is not None and need.priority.name.lower() not in self.priorities:
            return False
        if self.max_output_tokens is not None and (
            need.max_tokens is None or need.max_tokens > self.max_output_tokens
        ):
            return False
        return self.max_input_tokens is None or need.input_tokens <= self.max_input_tokens


class BrownoutConfig(_Section):
    """Under overload, send these priorities to a cheaper tier before refusing anything."""

    enabled: bool = True
    priorities: list[PriorityName] = Field(default_factory=lambda: ["low", "normal"])
    # The primary tier is overloaded at this many requests in flight per routable replica
    # (the autoscaler's target_concurrency is a good value: it is what one replica is
    # sized for); a cheaper tier has room below the same.
    max_in_flight_per_replica: float = Field(default=8.0, gt=0)


def check_tiers(tiers: Sequence[TierConfig], rules: Sequence[TierRule]) -> None:
    """Names unique; every rule names a tier (or `primary`). Raises ValueError naming it."""
    names = [tier.name for tier in tiers]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"tier {name!r} is configured twice")
    rule_names = [rule.name for rule in rules]
    for rule in rules:
        if rule_names.count(rule.name) > 1:
            raise ValueError(f"tier rule {rule.name!r} is configured twice")
        if rule.name in {r.value for r in TierReason}:
            raise ValueError(f"tier rule name {rule.name!r} is reserved")
        if rule.tier != PRIMARY and rule.tier not in names:
            raise ValueError(
                f"tier rule {rule.name!r} names tier {rule.tier!r}; configured: "
                f"{', '.join([PRIMARY, *names])}"
            )


class TierReason(StrEnum):
    DEFAULT = "default"  # nothing asked for another tier
    REQUESTED = "requested"  # the client named the tier
    DENIED = "denied"  # the client named a dearer tier than the rules give it
    BROWNOUT = "brownout"  # the primary was overloaded
    OPTED_OUT = "opted_out"  # a rule or brown-out would have degraded it; the tenant said no
    UNAVAILABLE = "unavailable"  # the tier chosen had no routable replica


@dataclass(frozen=True)
class TierNeed:
    """What the decision reads of a request."""

    priority: Priority
    max_tokens: int | None
    input_tokens: int
    requested: str | None = None  # the tier the client named


@dataclass(frozen=True)
class TierLoad:
    routable: int  # replicas that can take a request now
    in_flight: int  # requests the gateway has there

    def has_room(self, per_replica: float) -> bool:
        return self.routable > 0 and self.in_flight < self.routable * per_replica


@dataclass(frozen=True)
class TierDecision:
    tier: str
    reason: str  # a TierReason, or the name of the rule that matched


def lowest_rank(tenant: TenantConfig, tiers: Sequence[TierConfig]) -> int:
    """The cheapest tier (0: primary; i: tiers[i - 1]) the tenant may be degraded to."""
    if not tenant.allow_degraded:
        return 0
    if tenant.min_variant is None:
        return len(tiers)
    for rank, tier in enumerate(tiers, start=1):
        if tier.variant == tenant.min_variant:
            return rank
    return 0  # the primary's own variant (or one no tier serves): never below the primary


def choose_tier(
    tiers: Sequence[TierConfig],
    rules: Sequence[TierRule],
    brownout: BrownoutConfig,
    need: TierNeed,
    tenant: TenantConfig,
    loads: Mapping[str, TierLoad],
) -> TierDecision:
    """Which tier serves a request (see the module doc). `loads` has every tier, primary
    included; a tier missing from it has no replica."""
    ruled = _rules_and_brownout(tiers, rules, brownout, need, tenant, loads)
    requested = need.requested
    if requested is None:
        return ruled
    rank = _ranks(tiers)
    if rank[requested] < rank[ruled.tier] and requested not in tenant.may_request_tiers:
        return TierDecision(ruled.tier, TierReason.DENIED)
    if loads.get(requested, TierLoad(0, 0)).routable > 0:
        return TierDecision(requested, TierReason.REQUESTED)
    return TierDecision(ruled.tier, TierReason.UNAVAILABLE)


def _ranks(tiers: Sequence[TierConfig]) -> dict[str, int]:
    """Each tier's rank, best first: the primary 0, then the configured order."""
    return {PRIMARY: 0} | {tier.name: i for i, tier in enumerate(tiers, start=1)}


def _rules_and_brownout(
    tiers: Sequence[TierConfig],
    rules: Sequence[TierRule],
    brownout: BrownoutConfig,
    need: TierNeed,
    tenant: TenantConfig,
    loads: Mapping[str, TierLoad],
) -> TierDecision:
    """Steps 1 to 3 of the module doc: the tier the request gets without naming one."""
    rank = _ranks(tiers)
    empty = TierLoad(0, 0)

    def routable(name: str) -> bool:
        return loads.get(name, empty).routable > 0

    lowest = lowest_rank(tenant, tiers)
    held_back = False
    for rule in rules:
        if not rule.matches(need):
            continue
        if rank[rule.tier] > lowest:
            held_back = True
            continue
        if routable(rule.tier):
            return TierDecision(rule.tier, rule.name)
    per_replica = brownout.max_in_flight_per_replica
    priority = need.priority.name.lower()
    overloaded = not loads.get(PRIMARY, empty).has_room(per_replica)
    if brownout.enabled and tiers and overloaded and priority in brownout.priorities:
        for tier in tiers[:lowest]:
            if loads.get(tier.name, empty).has_room(per_replica):
                return TierDecision(tier.name, TierReason.BROWNOUT)
        # A tier below the tenant's floor had room: brown-out would have sent it there.
        held_back |= any(loads.get(t.name, empty).has_room(per_replica) for t in tiers[lowest:])
    return TierDecision(PRIMARY, TierReason.OPTED_OUT if held_back else TierReason.DEFAULT)
