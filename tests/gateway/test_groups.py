"""Replica groups: the key the gateway's routers and the supervisor share, and the order
in which a request's groups are tried."""

from __future__ import annotations

from modelship.gateway.groups import CANARY, STABLE, all_groups, fallback_order, tier_group
from modelship.gateway.tiers import PRIMARY


def test_every_group_but_stable_falls_back_to_stable() -> None:
    economy = tier_group("economy")
    assert fallback_order(STABLE) == (STABLE,)
    assert fallback_order(CANARY) == (CANARY, STABLE)
    assert fallback_order(economy) == (economy, STABLE)
    assert tier_group(PRIMARY) == STABLE  # the primary tier's group is the stable track's


def test_a_group_is_labelled_by_its_track_or_else_its_tier() -> None:
    groups = all_groups(["economy", "int8"])
    assert [group.label for group in groups] == ["stable", "canary", "economy", "int8"]
    assert [str(group) for group in groups][2:] == ["tier economy", "tier int8"]
    assert len(set(groups)) == 4  # dict keys, equal by value
