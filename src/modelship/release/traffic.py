"""Which releases take traffic: `production` (stable) and, optionally, a canary.

The plan is a file, `models/<slug>/traffic.json`, next to the `production` link: the
`modelship release` commands write it (atomically, under the model's lock) and a running
fleet reads it every second, so release control works the same whether the fleet was
started in this shell, another one, or by a supervisor on another machine sharing the
storage. Every change is appended to `events`, the release history operators read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelship.errors import PipelineError
from modelship.release.provenance import PROVENANCE_FILE, actor, artifact_identity
from modelship.storage import Storage
from modelship.storage.manifest import now_iso
from modelship.storage.store import write_json_atomic

TRAFFIC_FILE = "traffic.json"
_MAX_EVENTS = 200


@dataclass(frozen=True)
class CanaryPlan:
    release: int
    weight: int  # percent of traffic, 1..99


@dataclass(frozen=True)
class TrafficPlan:
    canary: CanaryPlan | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        canary = None
        if self.canary is not None:
            canary = {"release": self.canary.release, "weight": self.canary.weight}
        return {"canary": canary, "events": self.events[-_MAX_EVENTS:]}


def traffic_path(storage: Storage, slug: str) -> Path:
    return storage.model_dir(slug) / TRAFFIC_FILE


def read_traffic(storage: Storage, slug: str) -> TrafficPlan:
    """The current plan; no file means no canary."""
    path = traffic_path(storage, slug)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return TrafficPlan()
    except json.JSONDecodeError as exc:
        raise PipelineError(f"{path}: not valid JSON: {exc}") from None
    canary = data.get("canary")
    plan = None
    if canary is not None:
        plan = CanaryPlan(release=int(canary["release"]), weight=int(canary["weight"]))
    return TrafficPlan(plan, list(data.get("events", [])))


def _write(storage: Storage, slug: str, canary: CanaryPlan | None, event: dict[str, Any]):
    path = traffic_path(storage, slug)
    with storage.lock(path):
        plan = read_traffic(storage, slug)
        events = [*plan.events, {"at": now_iso(), "by": actor(), **event}]
        new = TrafficPlan(canary, events)
        write_json_atomic(path, new.to_json())
    return new


def start_canary(storage: Storage, slug: str, release: int, weight: int) -> TrafficPlan:
    """Send `weight` percent of traffic (sticky per session) to `release`."""
    if not 1 <= weight <= 99:
        raise PipelineError(f"--weight must be between 1 and 99 (percent), got {weight}")
    releases = storage.releases(slug)
    if release not in releases:
        raise PipelineError(f"release {release} does not exist (releases: {_listed(releases)})")
    production = storage.production_release(slug)
    if production is None:
        raise PipelineError(f"{slug} has no production release to compare a canary with")
    if release == production:
        raise PipelineError(f"release {release} is already production")
    canary = CanaryPlan(release, weight)
    return _write(storage, slug, canary, {"action": "canary", "release": release, "weight": weight})


def promote_canary(storage: Storage, slug: str) -> tuple[int | None, int]:
    """Make the canary production; returns (old production, new production)."""
    plan = read_traffic(storage, slug)
    if plan.canary is None:
        raise PipelineError(f"{slug} has no canary to promote")
    before = storage.production_release(slug)
    storage.set_production(slug, plan.canary.release)
    _write(storage, slug, None, {"action": "promote", "release": plan.canary.release})
    return before, plan.canary.release


def rollback(storage: Storage, slug: str, to: int | None = None) -> tuple[int | None, int]:
    """Point production at release `to` (default: the newest one before the current).
    Refuses, changing nothing, where there is nothing to roll back to or `to` is production
    already."""
    current = storage.production_release(slug)
    releases = storage.releases(slug)
    if not releases:
        raise PipelineError(f"{slug} has no release yet (`modelship select` publishes one)")
    if to is None:
        if current is None:
            raise PipelineError(
                f"{slug} has no production release to roll back from; name one: "
                f"`modelship rollback --to N` (releases: {_listed(releases)})"
            )
        older = [n for n in releases if n < current]
        if not older:
            raise PipelineError(
                f"no release before {current} to roll back to (releases: {_listed(releases)})"
            )
        to = older[-1]
    if to not in releases:
        raise PipelineError(f"release {to} does not exist (releases: {_listed(releases)})")
    if to == current:
        raise PipelineError(f"release {to} is already production; nothing changed")
    storage.set_production(slug, to)
    return current, to


def _listed(releases: list[int]) -> str:
    return ", ".join(map(str, releases)) or "none"


def record_event(storage: Storage, slug: str, event: dict[str, Any]) -> None:
    """Append an event that does not change the canary (e.g. production pointed at an
    older release by `modelship rollback`) to the history."""
    _write(storage, slug, read_traffic(storage, slug).canary, event)


def end_canary(storage: Storage, slug: str, reason: str, automatic: bool = False) -> int | None:
    """Send all traffic back to production; returns the canary's release (None: none ran)."""
    plan = read_traffic(storage, slug)
    if plan.canary is None:
        return None
    action = "auto_rollback" if automatic else "rollback"
    event = {"action": action, "release": plan.canary.release, "reason": reason}
    _write(storage, slug, None, event)
    return plan.canary.release


def release_record(storage: Storage, slug: str, release: int) -> dict[str, Any]:
    """Release `release`'s provenance (`provenance.json`, written by select) with its
    history since publication joined in: canary weights, judge decisions, rollbacks,
    promotions, each with who and when."""
    releases = storage.releases(slug)
    if release not in releases:
        raise PipelineError(f"release {release} does not exist (releases: {_listed(releases)})")
    path = storage.release_dir(slug, release) / PROVENANCE_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:  # published before provenance existed: what its manifest says
        record = {"release": release, "model": slug, "note": f"{path} does not exist"}
        record["artifact"] = artifact_identity(storage.release_dir(slug, release))
    except json.JSONDecodeError as exc:
        raise PipelineError(f"{path}: not valid JSON: {exc}") from None
    plan = read_traffic(storage, slug)
    record["history"] = [e for e in plan.events if e.get("release") == release]
    record["production"] = storage.production_release(slug) == release
    canary = plan.canary if plan.canary is not None and plan.canary.release == release else None
    record["canary"] = None if canary is None else {"weight": canary.weight}
    return record
