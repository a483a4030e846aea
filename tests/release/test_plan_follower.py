"""What a standalone gateway makes of the release plan (`standalone_canary_weight`), and
the follower's reads of the plan written by the release functions on a real storage."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelship.errors import PipelineError
from modelship.fleet.plan_follower import PROMOTED_WEIGHT, PlanFollower, standalone_canary_weight
from modelship.release.traffic import (
    CanaryPlan,
    TrafficPlan,
    end_canary,
    promote_canary,
    start_canary,
    traffic_path,
)

from fleet_storage import placeholder_releases

SLUG = "tiny"


def test_the_weight_under_each_plan() -> None:
    assert standalone_canary_weight(TrafficPlan(), 1) == 0
    assert standalone_canary_weight(TrafficPlan(CanaryPlan(2, 30)), 1) == 30
    assert standalone_canary_weight(TrafficPlan(CanaryPlan(2, 30)), 2) == 0  # already production
    promoted = TrafficPlan(None, [{"action": "canary", "release": 2, "weight": 30},
                                  {"action": "promote", "release": 2}])  # fmt: skip
    assert standalone_canary_weight(promoted, 2) == PROMOTED_WEIGHT
    # production pointed elsewhere since (`modelship rollback`): the stable track again
    moved = TrafficPlan(None, [*promoted.events, {"action": "production", "release": 1}])
    assert standalone_canary_weight(moved, 1) == 0
    rolled_back = TrafficPlan(None, [{"action": "canary", "release": 2, "weight": 30},
                                     {"action": "auto_rollback", "release": 2}])  # fmt: skip
    assert standalone_canary_weight(rolled_back, 1) == 0


def test_the_follower_applies_what_the_release_commands_wrote(tmp_path: Path) -> None:
    storage = placeholder_releases(tmp_path, SLUG)
    seen: list[int] = []
    follower = PlanFollower(storage, SLUG, lambda p, prod: seen.append(
        standalone_canary_weight(p, prod)))  # fmt: skip
    follower.sync()
    start_canary(storage, SLUG, 2, 40)
    follower.sync()
    end_canary(storage, SLUG, "test")
    follower.sync()
    start_canary(storage, SLUG, 2, 10)
    promote_canary(storage, SLUG)
    follower.sync()
    assert seen == [0, 40, 0, PROMOTED_WEIGHT]
    traffic_path(storage, SLUG).write_text("{half a plan")
    with pytest.raises(PipelineError, match="not valid JSON"):  # `run` logs it, keeps the last
        follower.sync()
    assert seen == [0, 40, 0, PROMOTED_WEIGHT]
