"""The autoscaling policy: from load and replica counts to a desired replica count.

Pure apart from its recommendation history; time comes in as `now`. It follows the
Kubernetes HPA's stabilization rule, so the local controller and a rendered HPA behave
alike:

- each call's recommendation is ceil(in_flight / target_concurrency), clamped to
  [min_replicas, max_replicas] (min >= 1: one warm replica always);
- scale up to the LOWEST recommendation in the last `scale_up_window_s` (a one-sample
  spike does not start a replica; sustained load does, within the short window);
- scale down to the HIGHEST recommendation in the last `scale_down_window_s` (load
  must stay low for the whole long window before capacity goes);
- capacity is ready + starting replicas: a replica still loading its model is capacity
  on its way, so the policy does not ask for it again while it starts;
- with `anticipate` (the local fleet; an HPA has no such rule), a rising load is met where
  it will be once a replica started now is ready: the in-flight trend (least-squares slope
  over `trend_window_s`) extrapolated over the expected time to ready, which the caller
  learns from the replicas it started. The growth counted is capped at a doubling of the
  load (plus one replica's worth from idle), and a falling load is never anticipated:
  capacity goes only after the long down-window, as without it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator


class AutoscalerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=4, ge=1)
    target_concurrency: float = Field(default=8.0, gt=0)  # requests in flight per replica
    scale_up_window_s: float = Field(default=3.0, ge=0)
    scale_down_window_s: float = Field(default=300.0, ge=0)
    max_scale_up_step: int | None = Field(default=None, ge=1)  # replicas per decision
    max_scale_down_step: int | None = Field(default=None, ge=1)
    # Scale for the load expected once a replica started now is ready (see the module doc).
    anticipate: bool = True
    trend_window_s: float = Field(default=10.0, gt=0)
    # The time to ready assumed before the fleet has timed a replica of its own.
    initial_time_to_ready_s: float = Field(default=10.0, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalerConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})"
            )
        return self


class ScaleReason(StrEnum):
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    STEADY = "steady"  # the load fits the current capacity
    UP_STABILIZING = "up_stabilizing"  # more is needed now, not yet for the whole up-window
    DOWN_STABILIZING = "down_stabilizing"  # less is needed now, not for the whole down-window


@dataclass(frozen=True)
class ScaleDecision:
    desired_replicas: int
    current_replicas: int  # ready + starting
    recommendation: int  # this call's clamped ceil(load / target), before stabilization
    reason: ScaleReason
    # The load the recommendation is for: the in-flight count now, or where its trend
    # will have taken it after `time_to_ready_s` (with `anticipate`).
    projected_in_flight: float = 0.0
    time_to_ready_s: float = 0.0

    @property
    def delta(self) -> int:
        return self.desired_replicas - self.current_replicas

    def describe(self) -> str:
        return (
            f"{self.reason}: {self.current_replicas} -> {self.desired_replicas} replicas "
            f"(load asks for {self.recommendation}; {self.projected_in_flight:.1f} in flight "
            f"expected in {self.time_to_ready_s:.1f}s)"
        )


class _WindowExtreme:
    """The max (or min) of the values pushed in the last `window_s` seconds.

    A monotonic deque: values that can never be the extreme again are dropped on push,
    so it holds at most one entry per distinct value (here: per replica count).
    """

    def __init__(self, window_s: float, keep_max: bool) -> None:
        self.window_s = window_s
        self.keep_max = keep_max
        self._entries: deque[tuple[float, int]] = deque()

    def push(self, now: float, value: int) -> int:
        dominated = (lambda old: old <= value) if self.keep_max else (lambda old: old >= value)
        while self._entries and dominated(self._entries[-1][1]):
            self._entries.pop()
        self._entries.append((now, value))
        while self._entries[0][0] < now - self.window_s:
            self._entries.popleft()
        return self._entries[0][1]


class _Trend:
    """The least-squares slope of the samples pushed in the last `window_s` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def push(self, now: float, value: float) -> float:
        self._samples.append((now, value))
        while self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        n = len(self._samples)
        if n < 2:
            return 0.0
        mean_t = sum(t for t, _ in self._samples) / n
        mean_v = sum(v for _, v in self._samples) / n
        spread = sum((t - mean_t) ** 2 for t, _ in self._samples)
        if spread == 0:
            return 0.0
        return sum((t - mean_t) * (v - mean_v) for t, v in self._samples) / spread


class AutoscalerPolicy:
    """Call `decide` on every control tick; act on `desired_replicas`."""

    def __init__(self, config: AutoscalerConfig | None = None) -> None:
        self.config = config or AutoscalerConfig()
        self._up = _WindowExtreme(self.config.scale_up_window_s, keep_max=False)
        self._down = _WindowExtreme(self.config.scale_down_window_s, keep_max=True)
        self._trend = _Trend(self.config.trend_window_s)

    def recommend(self, in_flight: float) -> int:
        config = self.config
        wanted = math.ceil(max(0.0, in_flight) / config.target_concurrency)
        return min(config.max_replicas, max(config.min_replicas, wanted))

    def project(self, now: float, in_flight: float, time_to_ready_s: float) -> float:
        """The load to provision for: `in_flight`, plus its rising trend over
        `time_to_ready_s` with `anticipate`, the growth capped at a doubling (one
        replica's worth from idle)."""
        slope = self._trend.push(now, in_flight)
        if not self.config.anticipate or slope <= 0:
            return in_flight
        cap = max(in_flight, self.config.target_concurrency)
        return in_flight + min(cap, slope * time_to_ready_s)

    def decide(
        self,
        now: float,
        in_flight: float,
        ready_replicas: int,
        starting_replicas: int = 0,
        time_to_ready_s: float | None = None,
    ) -> ScaleDecision:
        """`in_flight`: requests in flight or waiting across the fleet; replicas being
        drained count in neither replica argument. `time_to_ready_s`: how long a replica
        started now is expected to take (None: `initial_time_to_ready_s`). `now` must not
        go backwards."""
        config = self.config
        current = ready_replicas + starting_replicas
        if time_to_ready_s is None:
            time_to_ready_s = config.initial_time_to_ready_s
        projected = self.project(now, max(0.0, in_flight), time_to_ready_s)
        recommendation = self.recommend(projected)
        up_to = self._up.push(now, recommendation)
        down_to = self._down.push(now, recommendation)
        if current < up_to:
            desired, reason = up_to, ScaleReason.SCALE_UP
            if config.max_scale_up_step is not None:
                desired = min(desired, current + config.max_scale_up_step)
        elif current > down_to:
            desired, reason = down_to, ScaleReason.SCALE_DOWN
            if config.max_scale_down_step is not None:
                desired = max(desired, current - config.max_scale_down_step)
        else:
            desired = current
            if recommendation > current:
                reason = ScaleReason.UP_STABILIZING
            elif recommendation < current:
                reason = ScaleReason.DOWN_STABILIZING
            else:
                reason = ScaleReason.STEADY
        # Outside [min, max] (a crash, a config change): back inside whatever the windows say.
        desired = min(config.max_replicas, max(config.min_replicas, desired))
        if desired > current:
            reason = ScaleReason.SCALE_UP
        elif desired < current:
            reason = ScaleReason.SCALE_DOWN
        return ScaleDecision(desired, current, recommendation, reason, projected, time_to_ready_s)
