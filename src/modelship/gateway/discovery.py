"""Replicas found in the Kubernetes API: every ready pod behind the engine's headless
Services is one upstream of the gateway's pool, so routing, breakers, ejection, retries and
mid-stream failover see each pod (a ClusterIP Service is one address; kube-proxy picks the
pod).

The wire: the EndpointSlices labelled `kubernetes.io/service-name` in `discovery.services`
are listed (their `resourceVersion` noted), then watched from that version with lightkube;
the watch resumes from the last event's version when the server ends it or the connection
breaks, and a 410 Gone (the version is too old for the server's history) or any other
failure relists, which reconciles whatever was missed. Each slice is kept whole, by name;
after every change the pool is made equal to the union of the slices' ready endpoints.

What a slice's labels say (the EndpointSlice controller copies the Service's labels onto
its slices; `deploy/deployment.py` renders them): `modelship.io/track` (stable or canary),
`modelship.io/tier` (a `gateway.tiers` name, or the primary), `modelship.io/release` and
`modelship.io/variant` (else the one each replica's /ready names, as for `--endpoint`), and
`modelship.io/model` (which model of several, `models.ModelCatalog.model_of_label`).

What it sees is on the gateway's public /metrics (`collect`):
`modelship_gateway_discovered_endpoints{model,track,tier}` (the ready endpoints of the
slices, by the group their labels give; `model` is "primary" for the gateway's own),
`modelship_gateway_discovery_lists_total` (the first list, then each relist) and
`modelship_gateway_discovery_watch_ends_total{reason}` (`resumed`: the connection broke and
the client resumed from the last version; `closed`: the watch ended without an error,
relisted; `expired`: a 410, relisted; `failed`: any other failure, relisted after a
backoff).

An endpoint that appears is routed to at once (its slice says ready: the kubelet's
readiness probe of /ready passed); one that turns not-ready or leaves every slice is
drained, as the supervisor drains a replica: no new requests, removed from the pool once
the gateway has none in flight there (or after `request_timeout_s`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx2
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ApiError
from lightkube.operators import in_
from lightkube.resources.discovery_v1 import EndpointSlice
from lightkube.types import OnErrorAction, OnErrorResult
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from modelship.gateway.canary import Track
from modelship.gateway.config import DiscoveryConfig
from modelship.gateway.engines import EngineKind
from modelship.gateway.groups import Group
from modelship.gateway.models import ModelCatalog, UnknownLabel
from modelship.gateway.pool import EndpointPool
from modelship.gateway.tiers import PRIMARY

logger = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"
TRACK_LABEL = "modelship.io/track"
TIER_LABEL = "modelship.io/tier"
RELEASE_LABEL = "modelship.io/release"
VARIANT_LABEL = "modelship.io/variant"
MODEL_LABEL = "modelship.io/model"
# The server ends each watch after this long and lightkube opens the next from the last
# version seen: a watch silently cut by a proxy is noticed within it.
WATCH_TIMEOUT_S = 240
MAX_BACKOFF_S = 5.0


@dataclass(frozen=True)
class DiscoveredEndpoint:
    """One ready pod of a slice, as the pool should have it."""

    endpoint_id: str  # the pod's name (the slice's targetRef), else address:port
    url: str
    group: Group
    release: str
    variant: str | None  # None: learnt from its /ready


def ready_endpoints(
    slice_: EndpointSlice,
    port_name: str,
    tier_names: set[str],
    catalog: ModelCatalog | None = None,
) -> list[DiscoveredEndpoint]:
    """The ready endpoints of one slice (a condition left unset means ready, as the API
    documents), with the group and release its labels give; none when the slice names no
    usable port or an unknown track, tier or model (logged)."""
    labels = dict(slice_.metadata.labels or {}) if slice_.metadata else {}
    name = slice_.metadata.name if slice_.metadata else "?"
    ports = slice_.ports or []
    port = next((p.port for p in ports if p.name == port_name), None)
    if port is None and len(ports) == 1:
        port = ports[0].port
    track_value, tier = labels.get(TRACK_LABEL, "stable"), labels.get(TIER_LABEL, PRIMARY)
    if port is None or track_value not in set(Track) or tier not in tier_names | {PRIMARY}:
        logger.warning("EndpointSlice %s: no port %r, or unknown track %r or tier %r: skipped",
                       name, port_name, track_value, tier)  # fmt: skip
        return []
    try:
        model = (catalog or ModelCatalog()).model_of_label(labels.get(MODEL_LABEL))
    except UnknownLabel as exc:
        logger.warning("EndpointSlice %s: model %r is none of the configured models "
                       "(`models:`): skipped", name, str(exc))  # fmt: skip
        return []
    # Another model's pods serve its primary tier (`gateway.tiers` are the primary's).
    group = Group(Track(track_value), tier if model is None else PRIMARY, model)
    release = labels.get(RELEASE_LABEL, track_value)
    found = []
    for endpoint in slice_.endpoints or []:
        conditions = endpoint.conditions
        if conditions is not None and conditions.ready is False:
            continue
        address = endpoint.addresses[0]
        host = f"[{address}]" if ":" in address else address
        ref = endpoint.targetRef
        endpoint_id = ref.name if ref is not None and ref.name else f"{host}:{port}"
        found.append(DiscoveredEndpoint(endpoint_id, f"http://{host}:{port}", group, release,
                                        labels.get(VARIANT_LABEL)))  # fmt: skip
    return found


class EndpointDiscovery:
    """Keeps the pool's discovered upstreams equal to the ready endpoints of the watched
    slices (see the module doc). Owns only the upstreams it added."""

    def __init__(
        self,
        config: DiscoveryConfig,
        pool: EndpointPool,
        engine: EngineKind,
        tier_names: set[str],
        client: AsyncClient | None = None,
        catalog: ModelCatalog | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.engine = engine
        self.tier_names = tier_names
        self.catalog = catalog or ModelCatalog()
        self.client = client or self._client(config)
        self.slices: dict[str, list[DiscoveredEndpoint]] = {}
        self.num_lists = 0  # lists done (the first, then one per relist)
        self.watch_ends = {"resumed": 0, "closed": 0, "expired": 0, "failed": 0}  # by reason
        self._owned: set[str] = set()
        self._draining: dict[str, float] = {}  # endpoint id -> when its drain began
        self._tasks: list[asyncio.Task] = []

    @staticmethod
    def _client(config: DiscoveryConfig) -> AsyncClient:
        if config.api_server:  # no credentials: a local proxy (kubectl proxy) or a test's
            kube = KubeConfig.from_one(cluster=Cluster(server=config.api_server), user=User(),
                                       namespace=config.namespace)  # fmt: skip
        else:
            kube = KubeConfig.from_service_account()
        # trust_env off: the API server is never reached through the environment's proxy.
        return AsyncClient(kube, namespace=config.namespace, trust_env=False)

    # Lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """List once before the gateway listens (a failure is logged and retried in the
        background), then watch and reap drained endpoints until `stop`."""
        version = None
        try:
            version = await self.relist()
        except Exception as exc:  # any failure: retried by `run`
            logger.warning("listing EndpointSlices of %s failed (%s): retrying",
                           ", ".join(self.config.services), exc)  # fmt: skip
        self._tasks = [asyncio.create_task(self.run(version)), asyncio.create_task(self._reap())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()

    async def run(self, version: str | None) -> None:
        """Watch from `version` (None: list first); relist on 410 and on any failure, a
        backoff apart when failures repeat."""
        failures = 0
        while True:
            try:
                if version is None:
                    version = await self.relist()
                await self.watch(version)
                failures = 0  # the watch ended without error: relist at once
                self.watch_ends["closed"] += 1
            except ApiError as exc:
                self.watch_ends["expired" if exc.status.code == 410 else "failed"] += 1
                if exc.status.code != 410:
                    failures += 1
                logger.info("EndpointSlice watch ended (%s %s): relisting",
                            exc.status.code, exc.status.message)  # fmt: skip
            except Exception as exc:  # the API server unreachable, a bad line
                self.watch_ends["failed"] += 1
                failures += 1
                logger.warning("EndpointSlice watch failed (%s): relisting", exc)
            version = None
            if failures:
                await asyncio.sleep(min(MAX_BACKOFF_S, 0.1 * 2**failures))

    async def relist(self) -> str:
        """Replace every slice with the listed ones and reconcile; returns the list's
        resourceVersion."""
        listing = self.client.list(EndpointSlice, namespace=self.config.namespace,
                                   labels={SERVICE_LABEL: in_(self.config.services)})  # fmt: skip
        slices = {s.metadata.name: self._endpoints(s) async for s in listing}
        self.slices = slices
        self.num_lists += 1
        self.reconcile()
        return listing.resourceVersion

    async def watch(self, version: str) -> None:
        events = self.client.watch(
            EndpointSlice, namespace=self.config.namespace,
            labels={SERVICE_LABEL: in_(self.config.services)}, resource_version=version,
            server_timeout=WATCH_TIMEOUT_S, on_error=self._on_watch_error,
        )  # fmt: skip
        async for kind, slice_ in events:
            name = slice_.metadata.name
            if kind == "DELETED":
                self.slices.pop(name, None)
            elif kind in ("ADDED", "MODIFIED"):
                self.slices[name] = self._endpoints(slice_)
            self.reconcile()

    def _endpoints(self, slice_: EndpointSlice) -> list[DiscoveredEndpoint]:
        return ready_endpoints(slice_, self.config.port, self.tier_names, self.catalog)

    # The pool ----------------------------------------------------------------------------
    def reconcile(self) -> None:
        """Add what appeared, retag what moved, drain what left (see the module doc)."""
        wanted = {found.endpoint_id: found for items in self.slices.values() for found in items}
        for endpoint_id, found in wanted.items():
            upstream = self.pool.get(endpoint_id)
            if upstream is not None and upstream.url != found.url:  # a new pod, same name
                self.pool.remove(endpoint_id)
                upstream = None
            if upstream is None:
                variant = found.variant or "unknown"
                upstream = self.pool.add(endpoint_id, found.url, found.group, found.release,
                                         variant, engine=self.engine)  # fmt: skip
                upstream.learns_variant = found.variant is None
                self._owned.add(endpoint_id)
            elif upstream.group != found.group:
                self.pool.retag(endpoint_id, found.group)
            if upstream.is_draining:  # ready again
                upstream.is_draining = False
                self.pool.refresh(upstream)
            self._draining.pop(endpoint_id, None)
        for endpoint_id in self._owned - wanted.keys():
            if endpoint_id not in self._draining:
                logger.info("%s left the EndpointSlices or is not ready: draining", endpoint_id)
                self._draining[endpoint_id] = time.monotonic()
                self.pool.drain(endpoint_id)
        self.remove_drained()

    def remove_drained(self) -> None:
        """Remove the drained endpoints the gateway has nothing in flight on (or that have
        drained for `request_timeout_s`)."""
        overdue_s = self.pool.config.request_timeout_s
        now = time.monotonic()
        for endpoint_id, since in list(self._draining.items()):
            upstream = self.pool.get(endpoint_id)
            if upstream is None or upstream.endpoint.in_flight == 0 or now - since > overdue_s:
                self.pool.remove(endpoint_id)
                self._owned.discard(endpoint_id)
                del self._draining[endpoint_id]

    # Metrics (a prometheus_client collector) -----------------------------------------------
    def collect(self):
        endpoints = GaugeMetricFamily(
            "modelship_gateway_discovered_endpoints",
            "Ready endpoints of the watched EndpointSlices, by the model, track and tier their "
            "labels give (model primary: the gateway's own).",
            labels=["model", "track", "tier"],
        )
        counts: dict[tuple[str, str, str], int] = {}
        for found in (found for items in self.slices.values() for found in items):
            key = (found.group.model or PRIMARY, str(found.group.track), found.group.tier)
            counts[key] = counts.get(key, 0) + 1
        for key, count in sorted(counts.items()):
            endpoints.add_metric(list(key), count)
        yield endpoints
        lists = CounterMetricFamily(
            "modelship_gateway_discovery_lists",
            "EndpointSlice lists: the first, then one per relist (after a 410 or a failure).",
        )
        lists.add_metric([], self.num_lists)
        yield lists
        ends = CounterMetricFamily(
            "modelship_gateway_discovery_watch_ends",
            "EndpointSlice watches ended, by reason: resumed (a broken connection, resumed "
            "from its version), closed (ended without error: relisted), expired (410: "
            "relisted), failed (relisted after a backoff).",
            labels=["reason"],
        )
        for reason, count in self.watch_ends.items():
            ends.add_metric([reason], count)
        yield ends

    def _on_watch_error(self, exc: Exception, num_errors: int) -> OnErrorResult:
        """A broken connection resumes from the last version seen (lightkube's retry); a
        410 and repeated failures end the watch, and `run` relists."""
        if (isinstance(exc, ApiError) or not isinstance(exc, httpx2.TransportError)
                or num_errors > 3):  # fmt: skip
            return OnErrorResult(OnErrorAction.RAISE)
        self.watch_ends["resumed"] += 1
        return OnErrorResult(OnErrorAction.RETRY, sleep=0.1 * 2**num_errors)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            self.remove_drained()
