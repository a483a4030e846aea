"""The autoscaler policy on scripted load traces (one tick per second unless stated)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from modelship.autoscale import AutoscalerConfig, AutoscalerPolicy, ScaleReason


def make_policy(**overrides) -> AutoscalerPolicy:
    options = {
        "min_replicas": 1,
        "max_replicas": 8,
        "target_concurrency": 4,
        "scale_up_window_s": 3,
        "scale_down_window_s": 60,
        "anticipate": False,
    } | overrides
    return AutoscalerPolicy(AutoscalerConfig(**options))


class Fleet:
    """A stand-in controller: acts on each decision; new replicas take `start_s` to load."""

    def __init__(self, policy: AutoscalerPolicy, ready: int = 1, start_s: float = 20) -> None:
        self.policy = policy
        self.ready = ready
        self.start_s = start_s
        self.starting: list[float] = []  # when each starting replica becomes ready
        self.num_started = 0

    def tick(self, now: float, in_flight: float):
        self.ready += sum(1 for t in self.starting if t <= now)
        self.starting = [t for t in self.starting if t > now]
        decision = self.policy.decide(
            now, in_flight, self.ready, len(self.starting), time_to_ready_s=self.start_s
        )
        for _ in range(max(0, decision.delta)):
            self.starting.append(now + self.start_s)
            self.num_started += 1
        for _ in range(max(0, -decision.delta)):
            if self.starting:
                self.starting.pop()
            else:
                self.ready -= 1
        return decision


def test_config_checks() -> None:
    with pytest.raises(ValidationError, match="exceeds max_replicas"):
        AutoscalerConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError, match="min_replicas"):
        AutoscalerConfig(min_replicas=0)
    with pytest.raises(ValidationError, match="extra"):
        AutoscalerConfig(target=3)


def test_recommendation_is_ceil_of_load_over_target_clamped() -> None:
    policy = make_policy()
    assert [policy.recommend(x) for x in (0, 1, 4, 5, 12, 13, 1000)] == [1, 1, 1, 2, 3, 4, 8]


def test_scales_up_after_the_short_window_of_sustained_load() -> None:
    policy = make_policy()
    assert policy.decide(0, in_flight=0, ready_replicas=1).reason is ScaleReason.STEADY
    decisions = [policy.decide(t, in_flight=20, ready_replicas=1) for t in (1, 2, 3, 4)]
    assert [d.desired_replicas for d in decisions] == [1, 1, 1, 5]
    assert decisions[0].reason is ScaleReason.UP_STABILIZING
    assert decisions[0].recommendation == 5
    assert decisions[-1].reason is ScaleReason.SCALE_UP and decisions[-1].delta == 4
    assert "1 -> 5" in decisions[-1].describe()


def test_a_one_tick_spike_starts_nothing() -> None:
    policy = make_policy()
    loads = [0, 0, 40, 0, 0, 0, 0, 0]
    assert all(policy.decide(t, x, 1).desired_replicas == 1 for t, x in enumerate(loads))


def test_starting_replicas_prevent_double_scaling() -> None:
    fleet = Fleet(make_policy(scale_up_window_s=0), start_s=20)
    for t in range(30):  # the new replicas load for 20 s while the load stays high
        fleet.tick(t, in_flight=20)
    assert fleet.num_started == 4
    assert fleet.ready == 5 and not fleet.starting
    fleet.tick(30, in_flight=28)  # more load: only the difference starts
    assert fleet.num_started == 6


def test_scales_down_only_after_the_whole_long_window() -> None:
    policy = make_policy(scale_down_window_s=60)
    for t in range(11):
        policy.decide(t, in_flight=20, ready_replicas=5)
    held = [policy.decide(t, in_flight=2, ready_replicas=5) for t in range(11, 71)]
    assert all(d.desired_replicas == 5 for d in held)
    assert held[0].reason is ScaleReason.DOWN_STABILIZING
    down = policy.decide(71, in_flight=2, ready_replicas=5)
    assert down.reason is ScaleReason.SCALE_DOWN and down.desired_replicas == 1


def test_scale_down_goes_to_the_highest_load_of_the_window() -> None:
    policy = make_policy(scale_down_window_s=60)
    policy.decide(0, in_flight=32, ready_replicas=8)
    policy.decide(30, in_flight=12, ready_replicas=8)  # asks for 3
    assert policy.decide(61, in_flight=0, ready_replicas=8).desired_replicas == 3
    assert policy.decide(91, in_flight=0, ready_replicas=3).desired_replicas == 1


def test_clamps_and_repairs_out_of_range_fleets() -> None:
    policy = make_policy(min_replicas=2, max_replicas=4)
    assert policy.decide(0, in_flight=0, ready_replicas=2).desired_replicas == 2
    # A crash left no replica: back to min at once, whatever the up-window says.
    repaired = policy.decide(1, in_flight=0, ready_replicas=0)
    assert repaired.desired_replicas == 2 and repaired.reason is ScaleReason.SCALE_UP
    # Too many (a config change): down to max at once.
    assert policy.decide(2, in_flight=1000, ready_replicas=7).desired_replicas == 4


def test_step_limits() -> None:
    policy = make_policy(scale_up_window_s=0, max_scale_up_step=2, max_scale_down_step=1)
    assert policy.decide(0, in_flight=32, ready_replicas=1).desired_replicas == 3
    policy = make_policy(scale_down_window_s=0, max_scale_down_step=1)
    assert policy.decide(0, in_flight=0, ready_replicas=6).desired_replicas == 5


@settings(max_examples=100, deadline=None)
@given(
    loads=st.lists(st.floats(0, 100), min_size=1, max_size=60),
    min_replicas=st.integers(1, 3),
    extra=st.integers(0, 5),
    start_s=st.sampled_from([0, 5, 30]),
)
def test_fleet_stays_in_bounds_and_never_overshoots(
    loads: list[float], min_replicas: int, extra: int, start_s: float
) -> None:
    max_replicas = min_replicas + extra
    policy = make_policy(min_replicas=min_replicas, max_replicas=max_replicas)
    fleet = Fleet(policy, ready=min_replicas, start_s=start_s)
    for t, in_flight in enumerate(loads):
        decision = fleet.tick(t, in_flight)
        assert min_replicas <= decision.desired_replicas <= max_replicas
        # Capacity never exceeds the largest need seen over the last down-window.
        recent = loads[max(0, t - 60) : t + 1]
        need = max(policy.recommend(x) for x in recent)
        assert fleet.ready + len(fleet.starting) <= max(need, min_replicas)


def replica_seconds_short(policy: AutoscalerPolicy, loads: list[float], start_s: float) -> float:
    """Sum over ticks of the replicas the load needed and the fleet did not have ready."""
    fleet = Fleet(policy, ready=1, start_s=start_s)
    short = 0.0
    for t, in_flight in enumerate(loads):
        fleet.tick(t, in_flight)
        short += max(0, policy.recommend(in_flight) - fleet.ready)
    return short


def test_a_rising_load_is_met_where_it_will_be_once_replicas_are_ready() -> None:
    ramp = [2.0 * t for t in range(30)] + [60.0] * 30  # 2 more requests in flight a second
    late = replica_seconds_short(make_policy(max_replicas=16), ramp, start_s=10)
    ahead = replica_seconds_short(make_policy(max_replicas=16, anticipate=True), ramp, start_s=10)
    assert ahead <= late / 2, (ahead, late)
    # The time to ready sets how far ahead: 10 s at +2/s is +20 requests, 5 replicas' worth.
    policy = make_policy(max_replicas=16, anticipate=True, scale_up_window_s=0)
    for t in range(10):
        decision = policy.decide(t, in_flight=2.0 * t, ready_replicas=8, time_to_ready_s=10)
    assert decision.projected_in_flight == pytest.approx(18 + 18)  # growth capped at doubling
    assert decision.desired_replicas == 9
    assert "expected in 10.0s" in decision.describe()


def test_steady_or_falling_load_is_never_anticipated() -> None:
    steady = make_policy(anticipate=True)
    plain = make_policy()
    for t, load in enumerate([12.0] * 20 + [12.0 - 0.5 * t for t in range(20)]):
        a = steady.decide(t, load, ready_replicas=3, time_to_ready_s=30)
        b = plain.decide(t, load, ready_replicas=3, time_to_ready_s=30)
        assert a.projected_in_flight == load
        assert a.desired_replicas == b.desired_replicas


def test_without_a_time_to_ready_the_configured_initial_one_is_assumed() -> None:
    policy = make_policy(anticipate=True, initial_time_to_ready_s=4, scale_up_window_s=0)
    policy.decide(0, in_flight=0, ready_replicas=1)
    decision = policy.decide(1, in_flight=4, ready_replicas=1)
    assert decision.time_to_ready_s == 4
    assert decision.projected_in_flight == 4 + 4  # +4/s over 4 s, capped at doubling


@settings(max_examples=100, deadline=None)
@given(
    loads=st.lists(st.floats(0, 100), min_size=1, max_size=60),
    start_s=st.sampled_from([0, 5, 30]),
)
def test_anticipation_stays_in_bounds_and_within_a_doubling(
    loads: list[float], start_s: float
) -> None:
    policy = make_policy(min_replicas=1, max_replicas=8, anticipate=True)
    fleet = Fleet(policy, ready=1, start_s=start_s)
    for t, in_flight in enumerate(loads):
        decision = fleet.tick(t, in_flight)
        assert 1 <= decision.desired_replicas <= 8
        assert in_flight <= decision.projected_in_flight <= in_flight + max(in_flight, 4)
        recent = loads[max(0, t - 60) : t + 1]
        need = max(policy.recommend(x + max(x, 4)) for x in recent)
        assert fleet.ready + len(fleet.starting) <= need
