"""What the gateway's discovery reads from one EndpointSlice, and how it changes the pool
(`gateway/discovery.py`), without an API server: slices built as the API returns them."""

from __future__ import annotations

import pytest
from lightkube.resources.discovery_v1 import EndpointSlice

from modelship.config import ModelshipConfig
from modelship.fleet.standalone import GatewaySetupError, StandaloneGateway, StaticReplicas
from modelship.gateway.config import DiscoveryConfig, ResilienceConfig
from modelship.gateway.discovery import (
    RELEASE_LABEL,
    TIER_LABEL,
    TRACK_LABEL,
    VARIANT_LABEL,
    EndpointDiscovery,
    ready_endpoints,
)
from modelship.gateway.engines import EngineKind
from modelship.gateway.groups import CANARY, STABLE, tier_group
from modelship.gateway.pool import EndpointPool


def endpoint(address: str, pod: str | None, ready: bool | None = True) -> dict:
    found: dict = {"addresses": [address]}
    if ready is not None:
        found["conditions"] = {"ready": ready}
    if pod is not None:
        found["targetRef"] = {"kind": "Pod", "name": pod}
    return found


def slice_(endpoints: list[dict], labels: dict | None = None, ports: list | None = None):
    return EndpointSlice.from_dict({
        "addressType": "IPv4",
        "metadata": {"name": "engine-abcde", "labels": labels or {}},
        "endpoints": endpoints,
        "ports": ports if ports is not None else [{"name": "http", "port": 8000}],
    })  # fmt: skip


def test_ready_endpoints_are_the_ready_pods_on_the_named_port():
    found = ready_endpoints(
        slice_(
            [
                endpoint("10.0.0.1", "pod-a"),
                endpoint("10.0.0.2", "pod-b", ready=None),  # unset: ready, as the API says
                endpoint("10.0.0.3", "pod-c", ready=False),
                endpoint("fd00::4", None),
            ],
            ports=[{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
        ),
        "http",
        set(),
    )
    assert [(e.endpoint_id, e.url) for e in found] == [
        ("pod-a", "http://10.0.0.1:8000"),
        ("pod-b", "http://10.0.0.2:8000"),
        ("[fd00::4]:8000", "http://[fd00::4]:8000"),
    ]
    assert {(e.group, e.release, e.variant) for e in found} == {(STABLE, "stable", None)}


def test_the_slice_labels_give_the_group_release_and_variant():
    canary = slice_([endpoint("10.0.0.1", "p")], {TRACK_LABEL: "canary", RELEASE_LABEL: "4"})
    (found,) = ready_endpoints(canary, "http", set())
    assert (found.group, found.release) == (CANARY, "4")
    tier = slice_([endpoint("10.0.0.1", "p")], {TIER_LABEL: "economy", VARIANT_LABEL: "gptq"})
    (found,) = ready_endpoints(tier, "http", {"economy"})
    assert (found.group, found.variant) == (tier_group("economy"), "gptq")


@pytest.mark.parametrize(
    "labels, ports",
    [
        ({TIER_LABEL: "unknown"}, None),  # a tier this gateway does not serve
        ({TRACK_LABEL: "shadow"}, None),
        ({}, [{"name": "grpc", "port": 1}, {"name": "metrics", "port": 2}]),  # no "http"
    ],
)
def test_a_slice_the_gateway_cannot_route_to_gives_no_endpoint(labels, ports):
    assert ready_endpoints(slice_([endpoint("10.0.0.1", "p")], labels, ports), "http", set()) == []


def test_a_pod_that_leaves_is_drained_then_removed_when_nothing_is_in_flight():
    pool = EndpointPool(ResilienceConfig())
    config = DiscoveryConfig(services=["engine"], api_server="http://127.0.0.1:9")
    discovery = EndpointDiscovery(config, pool, EngineKind.MODELSHIP, set())
    two = slice_([endpoint("10.0.0.1", "pod-a"), endpoint("10.0.0.2", "pod-b")])
    discovery.slices = {"s": ready_endpoints(two, "http", set())}
    discovery.reconcile()
    assert {u.endpoint_id for u in pool} == {"pod-a", "pod-b"}
    pod_b = pool.get("pod-b")
    assert pod_b is not None and pod_b.learns_variant
    pod_b.endpoint.add_request(10)

    discovery.slices = {"s": ready_endpoints(slice_([endpoint("10.0.0.1", "pod-a")]),
                                             "http", set())}  # fmt: skip
    discovery.reconcile()
    assert pool.get("pod-b") is pod_b and not pod_b.endpoint.is_routable  # draining
    pod_b.endpoint.remove_request(10)
    discovery.remove_drained()
    assert {u.endpoint_id for u in pool} == {"pod-a"}


def test_a_draining_pod_that_is_ready_again_is_routed_to_again():
    pool = EndpointPool(ResilienceConfig())
    config = DiscoveryConfig(services=["engine"], api_server="http://127.0.0.1:9")
    discovery = EndpointDiscovery(config, pool, EngineKind.MODELSHIP, set())
    ready = ready_endpoints(slice_([endpoint("10.0.0.1", "pod-a")]), "http", set())
    discovery.slices = {"s": ready}
    discovery.reconcile()
    upstream = pool.get("pod-a")
    assert upstream is not None
    upstream.endpoint.add_request(1)
    discovery.slices = {}
    discovery.reconcile()
    assert upstream.is_draining
    discovery.slices = {"s": ready}
    discovery.reconcile()
    assert pool.get("pod-a") is upstream and upstream.endpoint.is_routable


def test_a_gateway_takes_addresses_or_discovery_not_both():
    config = ModelshipConfig.from_dict({})
    discovery = DiscoveryConfig(services=["engine"], api_server="http://127.0.0.1:9")
    with pytest.raises(GatewaySetupError, match="--endpoint and --discover-service"):
        StandaloneGateway(config, StaticReplicas(["http://127.0.0.1:1"]), discovery=discovery)
    with pytest.raises(GatewaySetupError, match="--discover-service"):
        StandaloneGateway(config, StaticReplicas([]))
