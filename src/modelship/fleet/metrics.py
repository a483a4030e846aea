"""The supervisor's metrics: replica starts, restarts and scaling, on the gateway's
registry, so one `/metrics` scrape shows the fleet and its traffic under one prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from modelship.gateway.metrics import PREFIX

_START_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.time_to_capacity = Histogram(
            PREFIX + "replica_time_to_ready_seconds",
            "From starting a replica process to its /ready answering 200.",
            ["release", "variant"],
            buckets=_START_BUCKETS,
            registry=registry,
        )
        self.scale_out = Histogram(
            PREFIX + "scale_out_seconds",
            "From the autoscaler asking for a replica to it taking traffic: `warm` from the "
            "warm pool, `cold` a process started for it.",
            ["source"],
            buckets=(0.01, 0.05, 0.1, 0.25, *_START_BUCKETS),
            registry=registry,
        )
        self.replica_restarts = Counter(
            PREFIX + "replica_restarts",
            "Replicas restarted after crashing.",
            ["release"],
            registry=registry,
        )
        self.scale_events = Counter(
            PREFIX + "scale_events",
            "Replicas started or drained by the autoscaler.",
            ["track", "direction"],
            registry=registry,
        )
        self.projected_in_flight = Gauge(
            PREFIX + "autoscaler_projected_in_flight",
            "The stable track's load the autoscaler provisions for: requests in flight now, "
            "or where their rising trend will be once a replica started now is ready.",
            registry=registry,
        )
        self.expected_time_to_ready = Gauge(
            PREFIX + "autoscaler_expected_time_to_ready_seconds",
            "The median of the latest stable replicas' times to ready: how far ahead a "
            "scale-out looks.",
            registry=registry,
        )
