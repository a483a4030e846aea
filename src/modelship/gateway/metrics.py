"""The gateway's Prometheus metrics, `modelship_gateway_*`, in two registries.

`fleet_registry`, for anyone: fleet-wide health read from live state at scrape time
(replicas, breakers, requests held by priority, canary weight, the replicas' engine series
summed by variant, `engine_load.py`) and what the local fleet's supervisor and drift
probe register there. `registry`, behind `gateway.metrics_api_key_sha256` wherever the
gateway has API keys: every series that moves per request (requests, tokens and cost by
tenant and model, routing and tier decisions, retries, latencies, breaker and canary
events). A tenant that could read those could tell from them what another tenant sent
(a routing reason confirms a guessed prompt) and how much it uses.

Request series carry the tenant, the status, and the release and variant that answered
(`release="none"` when no replica did: refused at the door, or no replica left).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from modelship.gateway.engine_load import EngineCollector, ReplicaEngine
from modelship.gateway.pool import EndpointPool
from modelship.gateway.tenants import Priority

PREFIX = "modelship_gateway_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0,
)  # fmt: skip


@dataclass(frozen=True)
class FleetSnapshot:
    """Live fleet state for the scrape: replicas per (track, release, variant, state),
    breaker state per endpoint, requests held by priority, desired replicas per track,
    and each replica's latest engine sample."""

    replicas: dict[tuple[str, str, str, str], int]
    breakers: dict[tuple[str, str], str]  # (endpoint_id, release) -> state
    held_by_priority: dict[str, int]
    desired_replicas: dict[str, int]
    canary_weight: int
    engines: list[ReplicaEngine] = field(default_factory=list)


def pool_snapshot(
    pool: EndpointPool, held: dict[Priority, int], canary_weight: int
) -> FleetSnapshot:
    """The snapshot of a pool's replicas (no desired counts: nothing scales them), with
    the requests `held` per priority."""
    replicas: dict[tuple[str, str, str, str], int] = {}
    for upstream in pool:
        state = "draining" if upstream.is_draining else "ready"
        if not upstream.is_healthy:
            state = "unhealthy"
        key = (str(upstream.track), upstream.release, upstream.variant, state)
        replicas[key] = replicas.get(key, 0) + 1
    return FleetSnapshot(
        replicas=replicas,
        breakers={(u.endpoint_id, u.release): str(u.breaker.state) for u in pool},
        held_by_priority={priority.name.lower(): count for priority, count in held.items()},
        desired_replicas={},
        canary_weight=canary_weight,
        engines=[
            ReplicaEngine(u.endpoint_id, u.variant, u.engine_sample)
            for u in pool
            if u.engine_sample is not None
        ],
    )


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


class GatewayMetrics:
    """Counters and histograms recorded by the request path (`registry`); fleet gauges
    from `snapshot` (`fleet_registry`)."""

    def __init__(self, snapshot: Callable[[], FleetSnapshot]) -> None:
        self.fleet_registry = CollectorRegistry()
        self.fleet_registry.register(_FleetCollector(snapshot))
        self.fleet_registry.register(
            EngineCollector(PREFIX + "replica_", lambda: snapshot().engines)
        )
        # Fleet health, public: the shared tenant quota store (`gateway.state`) not answering.
        self.state_failures = Counter(
            PREFIX + "state_failures",
            "Calls to the shared tenant quota store (gateway.state) that failed, by operation "
            "(admit: the request was refused or admitted unmetered per gateway.state_failure; "
            "settle: its slots wait for their lease, its reservation is not refunded; secret: "
            "the canary split's secret is this gateway's own; load: brown-out counts this "
            "gateway's requests only).",
            ["operation"],
            registry=self.fleet_registry,
        )
        self.registry = CollectorRegistry()
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

    def render(self, with_requests: bool = True) -> bytes:
        """The exposition text: the fleet's series, and with `with_requests` the request
        path's too."""
        text = generate_latest(self.fleet_registry)
        return text + generate_latest(self.registry) if with_requests else text
