"""Replica groups: which replicas may serve a request, and where it goes when they cannot.

A `Group` is a (track, tier, model) triple. The primary tier runs on two tracks: `STABLE` (the
production release) and `CANARY` (a release being judged, `canary.py`); each cheaper tier
(`tiers.py`, `gateway.tiers`) is one more group, of stable-track replicas serving its own
variant. With several models behind one gateway (`models.py`), each other model's replicas
form groups of their own, named by the model (`model` None: the gateway's primary model,
the one its config is about). The gateway keeps one router per group and the supervisor
one autoscaling state per group; both key them by this value, so no code filters replicas
by track, tier or model.

Fallbacks: a request's group is tried first; any group but its model's stable one then
falls back to that model's stable replicas (asked only when the group's own have failed):
the client gets an answer, and the canary judge has already counted a canary's failure. A
request a model tier sent to another model falls back to the model it asked for.
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
    model: str | None = None  # the served model name; None: the gateway's primary model

    @property
    def is_primary(self) -> bool:
        return self.tier == PRIMARY

    @property
    def label(self) -> str:
        """The group's name on gauges and scale events: the track for the primary tier,
        else the tier's (tier names may not be track names: `tiers._RESERVED`), after
        another model's name."""
        name = str(self.track) if self.is_primary else self.tier
        return name if self.model is None else f"{self.model}/{name}"

    def __str__(self) -> str:  # in log lines
        name = str(self.track) if self.is_primary else f"tier {self.tier}"
        return name if self.model is None else f"model {self.model} {name}"


STABLE = Group(Track.STABLE)
CANARY = Group(Track.CANARY)


def tier_group(tier: str, model: str | None = None) -> Group:
    """The group serving `tier` of `model` to the stable track: its stable group for the
    primary tier."""
    return Group(Track.STABLE, tier, model)


def model_group(model: str | None) -> Group:
    """`model`'s stable group (`STABLE` for the primary model)."""
    return Group(Track.STABLE, PRIMARY, model)


def fallback_order(group: Group, home: Group | None = None) -> tuple[Group, ...]:
    """The groups a request of `group` is tried on, in order (see the module doc); `home`:
    the stable group of the model the request asked for (default: `group`'s model's)."""
    home = home or model_group(group.model)
    return (group,) if group == home else (group, home)


def all_groups(tier_names: Iterable[str]) -> list[Group]:
    """Every group of a gateway serving these cheaper tiers, `STABLE` first."""
    return [STABLE, CANARY, *(tier_group(name) for name in tier_names)]
