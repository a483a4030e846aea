"""The replicas the gateway can send to, their health, and the active checks that keep it.

An `Upstream` is one replica as the request path sees it: the routing `Endpoint` (load),
its group (`groups.py`: track and tier) and release, the engine it runs
(`engines.EngineKind`), its circuit breaker and its last health check. The pool decides
routability in one place: healthy (the last check of the engine's health path was 200:
/ready for ours, /health for vLLM), not draining, breaker letting requests through, not
ejected by the outlier detector. Routers and the supervisor read it by group.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx

from modelship.gateway.canary import Track
from modelship.gateway.config import ResilienceConfig
from modelship.gateway.endpoint import Endpoint
from modelship.gateway.engine_load import EngineSample, parse_engine_sample
from modelship.gateway.engines import EngineKind
from modelship.gateway.groups import Group
from modelship.gateway.resilience import BreakerState, CircuitBreaker, OutlierDetector
from modelship.gateway.tiers import TierLoad

logger = logging.getLogger(__name__)


# Health checks in a row that got no answer at all (not even a 503) before a replica is
# taken for hung: the attempts waiting on it are then abandoned and retried elsewhere.
UNRESPONSIVE_AFTER_CHECKS = 2


@dataclass(eq=False)
class Upstream:
    endpoint: Endpoint
    group: Group
    variant: str
    breaker: CircuitBreaker
    engine: EngineKind = EngineKind.MODELSHIP
    # Given by address with no variant: the one its /ready names (`learn_variant`).
    learns_variant: bool = False
    is_healthy: bool = True
    is_draining: bool = False
    num_unanswered_checks: int = 0  # consecutive health checks that timed out or broke
    engine_sample: EngineSample | None = None  # its /metrics as last scraped
    _unresponsive: asyncio.Event = field(default_factory=asyncio.Event)
    _callbacks: set[Callable[[], None]] = field(default_factory=set)  # `on_unresponsive`

    @property
    def endpoint_id(self) -> str:
        return self.endpoint.endpoint_id

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def release(self) -> str:
        return self.endpoint.release or "unknown"

    @property
    def track(self) -> Track:
        return self.group.track

    @property
    def tier(self) -> str:
        return self.group.tier

    @property
    def is_unresponsive(self) -> bool:
        return self._unresponsive.is_set()

    def on_unresponsive(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` once the replica is taken for hung (at once if it is already);
        returns what unregisters it. A callback, not a waiting task: every attempt
        registers one, and a task per attempt was a measurable part of the gateway's
        overhead."""
        if self._unresponsive.is_set():
            callback()
            return lambda: None
        self._callbacks.add(callback)
        return lambda: self._callbacks.discard(callback)

    def record_check(self, answered: bool) -> None:
        """One health check's fate: answered (any status), or no answer in time."""
        self.num_unanswered_checks = 0 if answered else self.num_unanswered_checks + 1
        if self.num_unanswered_checks >= UNRESPONSIVE_AFTER_CHECKS:
            if not self._unresponsive.is_set():
                logger.warning(
                    "%s has not answered %d health checks: abandoning the attempts waiting "
                    "on it", self.endpoint_id, self.num_unanswered_checks,
                )  # fmt: skip
            self._unresponsive.set()
            callbacks, self._callbacks = self._callbacks, set()
            for callback in callbacks:
                callback()
        else:
            self._unresponsive.clear()


class EndpointPool:
    """Every known replica, by endpoint id."""

    def __init__(self, config: ResilienceConfig) -> None:
        self.config = config
        self.outliers = OutlierDetector(
            window_s=config.outlier_window_s,
            bucket_s=min(1.0, config.outlier_window_s),
            min_requests=config.outlier_min_requests,
            max_error_rate=config.outlier_max_error_rate,
            ejection_s=config.outlier_ejection_s,
        )
        self._upstreams: dict[str, Upstream] = {}

    def __len__(self) -> int:
        return len(self._upstreams)

    def __iter__(self):
        return iter(list(self._upstreams.values()))

    def get(self, endpoint_id: str) -> Upstream | None:
        return self._upstreams.get(endpoint_id)

    def add(
        self,
        endpoint_id: str,
        url: str,
        group: Group,
        release: str,
        variant: str = "unknown",
        is_healthy: bool = True,
        engine: EngineKind = EngineKind.MODELSHIP,
    ) -> Upstream:
        """Start routing to a replica (the supervisor calls this once /ready is 200)."""
        breaker = CircuitBreaker(
            failure_threshold=self.config.breaker_failure_threshold,
            cool_down_s=self.config.breaker_cool_down_s,
        )
        endpoint = Endpoint(endpoint_id=endpoint_id, url=url.rstrip("/"), release=release)
        upstream = Upstream(endpoint, group, variant, breaker, engine, is_healthy=is_healthy)
        self._upstreams[endpoint_id] = upstream
        self.outliers.set_endpoints(self._upstreams)
        self.refresh(upstream)
        logger.info("routing to %s (%s, release %s) at %s", endpoint_id, group, release, url)
        return upstream

    def remove(self, endpoint_id: str) -> None:
        if self._upstreams.pop(endpoint_id, None) is not None:
            self.outliers.set_endpoints(self._upstreams)
            logger.info("no longer routing to %s", endpoint_id)

    def drain(self, endpoint_id: str) -> None:
        """No new requests; the ones in flight finish."""
        upstream = self._upstreams.get(endpoint_id)
        if upstream is not None:
            upstream.is_draining = True
            self.refresh(upstream)

    def retag(self, endpoint_id: str, group: Group) -> None:
        """Move a replica to another group (a promoted canary's replicas become stable)."""
        upstream = self._upstreams.get(endpoint_id)
        if upstream is not None:
            upstream.group = group

    def refresh(self, upstream: Upstream) -> None:
        upstream.endpoint.is_routable = (
            upstream.is_healthy
            and not upstream.is_draining
            and upstream.breaker.can_send()
            and not self.outliers.is_ejected(upstream.endpoint_id)
        )

    def endpoints(self, group: Group) -> list[Endpoint]:
        """The group's endpoints with routability as of now (routers skip the others)."""
        result = []
        for upstream in self._upstreams.values():
            if upstream.group == group:
                self.refresh(upstream)
                result.append(upstream.endpoint)
        return result

    def can_resume(self) -> bool:
        """Every replica can resume a stream another one began (mid-stream failover)."""
        return all(upstream.engine.can_resume for upstream in self._upstreams.values())

    def has_routable(self, group: Group) -> bool:
        return any(endpoint.is_routable for endpoint in self.endpoints(group))

    def in_flight(self, group: Group) -> int:
        return sum(u.endpoint.in_flight for u in self._upstreams.values() if u.group == group)

    def load(self, group: Group) -> TierLoad:
        """The group's routable replicas and the requests the gateway has there (what a
        tier's choice reads)."""
        endpoints = self.endpoints(group)
        routable = sum(1 for endpoint in endpoints if endpoint.is_routable)
        return TierLoad(routable, sum(endpoint.in_flight for endpoint in endpoints))

    def record_result(self, upstream: Upstream, ok: bool) -> bool:
        """Feed breaker and outlier detector; returns True when this opened the breaker."""
        was_open = upstream.breaker.state is BreakerState.OPEN
        if ok:
            upstream.breaker.record_success()
        else:
            upstream.breaker.record_failure()
        self.outliers.record_result(upstream.endpoint_id, ok)
        self.refresh(upstream)
        return not was_open and upstream.breaker.state is BreakerState.OPEN


class HealthChecker:
    """Active checks: the health path of every replica (its engine's: /ready or /health)
    each `health_check_interval_s`, and its /metrics each `metrics_scrape_interval_s` for
    the load other gateways put on it."""

    def __init__(self, pool: EndpointPool, client: httpx.AsyncClient) -> None:
        self.pool = pool
        self.client = client

    async def run(self) -> None:
        config = self.pool.config
        interval = config.health_check_interval_s
        scrape_every = max(1, round(config.metrics_scrape_interval_s / interval))
        tick = 0
        while True:
            await self.check_all(scrape=tick % scrape_every == 0)
            tick += 1
            await asyncio.sleep(interval)

    async def check_all(self, scrape: bool = True) -> None:
        await asyncio.gather(*(self.check(u, scrape) for u in self.pool))

    async def check(self, upstream: Upstream, scrape: bool) -> None:
        timeout = self.pool.config.connect_timeout_s
        try:
            url = f"{upstream.url}{upstream.engine.health_path}"
            response = await self.client.get(url, timeout=timeout)
            healthy = response.status_code == 200
            upstream.record_check(answered=True)
            if healthy and upstream.learns_variant:
                learn_variant(upstream, response)
        except httpx.HTTPError as exc:
            healthy = False
            # Refused: the process is gone (its attempts fail on their own); silence: hung.
            upstream.record_check(answered=isinstance(exc, httpx.ConnectError))
        if healthy != upstream.is_healthy:
            logger.info("%s is %s", upstream.endpoint_id, "ready" if healthy else "not ready")
        upstream.is_healthy = healthy
        self.pool.refresh(upstream)
        if healthy and scrape:
            await self.scrape(upstream)

    async def scrape(self, upstream: Upstream) -> None:
        try:
            response = await self.client.get(
                f"{upstream.url}/metrics", timeout=self.pool.config.connect_timeout_s
            )
            response.raise_for_status()
        except httpx.HTTPError:
            return
        sample = parse_engine_sample(response.text)
        upstream.engine_sample = sample
        running, waiting = sample.get("num_requests_running"), sample.get("num_requests_waiting")
        upstream.endpoint.num_requests_running = None if running is None else int(running)
        upstream.endpoint.num_requests_waiting = None if waiting is None else int(waiting)


def learn_variant(upstream: Upstream, response: httpx.Response) -> None:
    """A replica given by address says what it serves in its /ready body (`modelship serve`
    reads it from the manifest of `production`, which only select knew): its answers are
    then labelled and priced as that variant. A body naming none changes nothing."""
    try:
        variant = response.json().get("variant")
    except (ValueError, AttributeError):  # not JSON, or not an object
        return
    if isinstance(variant, str) and variant and variant != upstream.variant:
        logger.info("%s serves variant %s", upstream.endpoint_id, variant)
        upstream.variant = variant


def static_upstreams(
    pool: EndpointPool,
    urls: Iterable[str],
    group: Group,
    release: str,
    variant: str | None = None,
    engine: EngineKind = EngineKind.MODELSHIP,
) -> None:
    """Endpoints given by address (Kubernetes Services): unhealthy until the first check.
    With no `variant` (the production and canary releases: which variant they serve is
    select's choice, made after the render), each one's is what its /ready says."""
    prefix = group.track if group.is_primary else f"tier-{group.tier}"
    for i, url in enumerate(urls):
        upstream = pool.add(f"{prefix}-{i}", url, group, release, variant or "unknown",
                            is_healthy=False, engine=engine)  # fmt: skip
        upstream.learns_variant = variant is None
