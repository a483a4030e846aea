"""Replica groups: which replicas may serve a request, and where it goes when they cannot.

A `Group` is a (track, tier) pair. The primary tier runs on two tracks: `STABLE` (the
production release) and `CANARY` (a release being judged, `canary.py`); each cheaper tier
(`tiers.py`, `gateway.tiers`) is one more group, of stable-track replicas serving its own
variant. The gateway keeps one router per group and the supervisor one autoscaling state
per group; both key them by this value, so no code filters replicas by track and tier.

Fallbacks: a request's group is tried first; any group but `STABLE` then falls back to
`STABLE`'s replicas (asked only when the group's own have failed): the client gets an
answer, and the canary judge has already counted a canary's failure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from modelship.gateway.canary import Track
from modelship.gateway.tiers import PRIMARY


@dataclass(frozen=True)
class Group:
    """Replicas serving one release's variant on one track: a dict key, compared by value."""

    track: Track
    tier: str = PRIMARY

    @property
    def is_primary(self) -> bool:
        return self.tier == PRIMARY

    @property
    def label(self) -> str:
        """The group's name on gauges and scale events: the track for the primary tier,
        else the tier's (tier names may not be track names: `tiers._RESERVED`)."""
        return str(self.track) if self.is_primary else self.tier

    def __str__(self) -> str:  # in log lines
        return str(self.track) if self.is_primary else f"tier {self.tier}"


STABLE = Group(Track.STABLE)
CANARY = Group(Track.CANARY)


def tier_group(tier: str) -> Group:
    """The group serving `tier` to the stable track: `STABLE` for the primary."""
    return Group(Track.STABLE, tier)


def fallback_order(group: Group) -> tuple[Group, ...]:
    """The groups a request of `group` is tried on, in order (see the module doc)."""
    return (group,) if group == STABLE else (group, STABLE)


def all_groups(tier_names: Iterable[str]) -> list[Group]:
    """Every group of a gateway serving these cheaper tiers, `STABLE` first."""
    return [STABLE, CANARY, *(tier_group(name) for name in tier_names)]
