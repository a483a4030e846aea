"""The gateway's Prometheus metrics, `modelship_gateway_*`.

Request series carry the tenant, the status, and the release and variant that answered
(`release="none"` when no replica did: refused at the door, or no replica left). Fleet
gauges (replicas, breakers, queue) are read from live state at scrape time.

Tenant names and what each tenant uses are not for everyone: `render(with_tenants=False)`
sums every series over its `tenant` label, which is what an anonymous scrape gets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

PREFIX = "modelship_gateway_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0,
)  # fmt: skip


@dataclass(frozen=True)
class FleetSnapshot:
    """Live fleet state for the scrape: replicas per (track, release, variant, state),
    breaker state per endpoint, requests held by priority, desired replicas per track."""

    replicas: dict[tuple[str, str, str, str], int]
    breakers: dict[tuple[str, str], str]  # (endpoint_id, release) -> state
    held_by_priority: dict[str, int]
    desired_replicas: dict[str, int]
    canary_weight: int


class _FleetCollector(Collector):
    def __init__(self, snapshot: Callable[[], FleetSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator:
        snap = self._snapshot()
        replicas = GaugeMetricFamily(
            PREFIX + "replicas",
            "Replicas by track, release, variant and state (starting, ready, unhealthy, draining).",
            labels=["track", "release", "variant", "state"],
        )
        for (track, release, variant, state), count in sorted(snap.replicas.items()):
            replicas.add_metric([track, release, variant, state], count)
        yield replicas
        desired = GaugeMetricFamily(
            PREFIX + "replicas_desired", "Replicas the autoscaler wants.", labels=["track"]
        )
        for track, count in sorted(snap.desired_replicas.items()):
            desired.add_metric([track], count)
        yield desired
        breakers = GaugeMetricFamily(
            PREFIX + "breaker_state",
            "1 for the state each replica's circuit breaker is in.",
            labels=["endpoint", "release", "state"],
        )
        for (endpoint_id, release), state in sorted(snap.breakers.items()):
            for name in ("closed", "open", "half_open"):
                breakers.add_metric([endpoint_id, release, name], 1.0 if state == name else 0.0)
        yield breakers
        queue = GaugeMetricFamily(
            PREFIX + "queue_length",
            "Requests held by the gateway (waiting or in flight), by priority.",
            labels=["priority"],
        )
        for priority, count in sorted(snap.held_by_priority.items()):
            queue.add_metric([priority], count)
        yield queue
        weight = GaugeMetricFamily(PREFIX + "canary_weight", "Percent of traffic to the canary.")
        weight.add_metric([], snap.canary_weight)
        yield weight


class _WithoutTenants(Collector):
    """Every series of `registry`, summed over the `tenant` label."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if not any("tenant" in sample.labels for sample in family.samples):
                yield family
                continue
            merged: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "tenant"))
                key = (sample.name, labels)
                if key not in merged:
                    merged[key] = sample.value
                elif sample.name.endswith("_created"):  # when the first series began
                    merged[key] = min(merged[key], sample.value)
                else:
                    merged[key] += sample.value
            summed = Metric(family.name, family.documentation, family.type, family.unit)
            for (name, labels), value in merged.items():
                summed.add_sample(name, dict(labels), value)
            yield summed


class GatewayMetrics:
    """Counters and histograms recorded by the request path; gauges from `snapshot`."""

    def __init__(self, snapshot: Callable[[], FleetSnapshot]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_FleetCollector(snapshot))
        self._without_tenants = CollectorRegistry(auto_describe=False)
        self._without_tenants.register(_WithoutTenants(self.registry))
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "Requests by tenant, final status, and the release/variant that answered.",
            ["tenant", "status", "release", "variant"],
            registry=r,
        )
        self.rejections = Counter(
            PREFIX + "rejections",
            "Requests refused before routing, by tenant and reason.",
            ["tenant", "reason"],
            registry=r,
        )
        self.tokens = Counter(
            PREFIX + "tokens",
            "Tokens charged to tenants, as the replica counted them (its usage).",
            ["tenant", "model", "variant", "kind"],
            registry=r,
        )
        self.cost = Counter(
            PREFIX + "cost",
            "What tenants' requests cost, at the variant's price per 1k tokens (gateway.cost).",
            ["tenant", "model", "variant"],
            registry=r,
        )
        self.routing_decisions = Counter(
            PREFIX + "routing_decisions",
            "Routing decisions by policy and reason (affinity hit, load bound, fallback...).",
            ["policy", "reason"],
            registry=r,
        )
        self.tier_decisions = Counter(
            PREFIX + "tier_decisions",
            "Which tier each request was sent to, and why (default, requested, brownout, "
            "opted_out, unavailable, or the name of the tier rule that matched).",
            ["tier", "reason"],
            registry=r,
        )
        self.retries = Counter(
            PREFIX + "retries",
            "Attempts retried on another replica, by failure kind.",
            ["kind"],
            registry=r,
        )
        self.failovers = Counter(
            PREFIX + "failovers",
            "Streams whose replica failed mid-stream, by outcome (resumed on another "
            "replica; exhausted: ended with an error event).",
            ["outcome"],
            registry=r,
        )
        self.upstream_failures = Counter(
            PREFIX + "upstream_failures",
            "Failed attempts at a replica, by release and failure kind.",
            ["release", "variant", "kind"],
            registry=r,
        )
        self.breaker_opened = Counter(
            PREFIX + "breaker_opened",
            "Times a replica's circuit breaker opened.",
            ["endpoint", "release"],
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_byte_seconds",
            "From the gateway receiving the request to the replica's first response byte.",
            ["release", "variant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Streams: from the gateway receiving the request to the first event carrying "
            "generated text (a role-only first chunk does not count).",
            ["release", "variant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            PREFIX + "request_duration_seconds",
            "Whole request as the gateway saw it.",
            ["release", "variant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.canary_rollbacks = Counter(
            PREFIX + "canary_rollbacks",
            "Canaries rolled back automatically.",
            ["release"],
            registry=r,
        )

    def render(self, with_tenants: bool = True) -> bytes:
        """The exposition text; without tenants, every series is summed over tenants."""
        return generate_latest(self.registry if with_tenants else self._without_tenants)
