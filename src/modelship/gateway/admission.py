"""Gateway-wide backpressure: a cap on requests held, shedding low priority first.

The gateway holds a request from admission until its response ends (waiting for a
replica, in flight, streaming). A request holds one slot per sequence it asks for (`n` per
prompt): the replica runs them all. Past the cap it answers 503 with Retry-After instead
of queueing without bound. Each priority has its own fill level: low priority is refused
once the gateway is `low_priority_fill` full, normal at `normal_priority_fill`, and high
only at the cap, so under saturation the lowest priority is shed first and the last
slots stay free for the most important traffic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from modelship.gateway.tenants import Priority


class AdmissionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Sequences waiting + in flight, whole gateway (a request with n=4 counts 4).
    max_requests: int = Field(default=256, ge=1)
    low_priority_fill: float = Field(default=0.5, gt=0, le=1)
    normal_priority_fill: float = Field(default=0.8, gt=0, le=1)
    retry_after_s: float = Field(default=1.0, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> AdmissionConfig:
        if self.low_priority_fill > self.normal_priority_fill:
            raise ValueError("low_priority_fill must not exceed normal_priority_fill")
        return self


@dataclass(frozen=True)
class AdmissionDecision:
    ok: bool
    # When refused: "priority_shed" or "queue_full" (503), or "too_many_sequences" (400:
    # more than this priority may ever hold at once).
    reason: str | None = None
    status_code: int = 200
    retry_after_s: float | None = None
    message: str = ""


class AdmissionQueue:
    """Counts the requests the gateway holds, per priority; admits under the limits."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self._held = {priority: 0 for priority in Priority}

    @property
    def num_held(self) -> int:
        return sum(self._held.values())

    def num_held_by_priority(self) -> dict[Priority, int]:
        return dict(self._held)

    def limit(self, priority: Priority) -> int:
        """How full the gateway may be for a request of `priority` to still get in."""
        fill = {
            Priority.LOW: self.config.low_priority_fill,
            Priority.NORMAL: self.config.normal_priority_fill,
            Priority.HIGH: 1.0,
        }[priority]
        # At least one slot, so an idle gateway never refuses anyone.
        return max(1, math.floor(fill * self.config.max_requests))

    def can_admit(self, priority: Priority, num_sequences: int = 1) -> bool:
        return self.num_held + num_sequences <= self.limit(priority)

    def try_admit(self, priority: Priority, num_sequences: int = 1) -> AdmissionDecision:
        """Hold `num_sequences` slots for a request of `priority`, or say why not (503 +
        Retry-After; 400 when the request could never fit)."""
        if num_sequences > self.limit(priority):
            return AdmissionDecision(
                ok=False,
                reason="too_many_sequences",
                status_code=400,
                message=f"the request asks for {num_sequences} sequences; at most "
                f"{self.limit(priority)} run at once for its priority",
            )
        if self.can_admit(priority, num_sequences):
            self._held[priority] += num_sequences
            return AdmissionDecision(ok=True)
        full = self.num_held + num_sequences > self.config.max_requests
        return AdmissionDecision(
            ok=False,
            reason="queue_full" if full else "priority_shed",
            status_code=503,
            retry_after_s=self.config.retry_after_s,
            message="the service is at capacity"
            if full
            else f"the service is shedding {priority.name.lower()}-priority requests",
        )

    def release(self, priority: Priority, num_sequences: int = 1) -> None:
        """Free the slots of an admitted request of `priority`, however it ended."""
        self._held[priority] = max(0, self._held[priority] - num_sequences)


def retry_after_header(retry_after_s: float) -> str:
    """The Retry-After value: whole seconds, at least 1, rounded up."""
    return str(max(1, math.ceil(retry_after_s)))
