"""The quality-drift probe: replay a release's golden prompts against each of its replicas.

`select` recorded the winner's greedy answers to the golden prompts, token by token with
logprobs (`golden.json` in the release, `modelship/release/golden.py`). The probe asks every
replica the same prompts directly (not through routing, admission or tenants) as soon as
it is ready and every `interval_s` after, and exports how much of the reference it
reproduced. A replica below `min_agreement` raises `modelship_gateway_drift_alert`; on the
canary track it is reported to `on_drift`, which `modelship up` (and the leader of the
standalone gateways, `fleet/plan_member.py`) answers by rolling the canary back, as it does
a slow one. Weights changed on disk, a wrong file, or a kernel
that computes differently all show up here, while latency and error rates look normal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from modelship.gateway.config import DriftProbeConfig
from modelship.gateway.metrics import PREFIX
from modelship.gateway.pool import EndpointPool, Upstream
from modelship.release import golden

logger = logging.getLogger(__name__)

# How often the loop looks for replicas not yet probed (a new replica is probed this soon).
TICK_S = 1.0


@dataclass
class ProbeResult:
    release: str
    variant: str
    track: str
    agreement: golden.Agreement
    at: float

    def drifted(self, min_agreement: float) -> bool:
        return self.agreement.tokens < min_agreement


class DriftProbe(Collector):
    """Probes the pool's replicas; a Prometheus collector of the last result of each."""

    def __init__(
        self,
        config: DriftProbeConfig,
        pool: EndpointPool,
        client: Callable[[], httpx.AsyncClient | None],
        reference: Callable[[str, str], list[golden.GoldenAnswer] | None],
        headers: dict[str, str] | None = None,
        on_drift: Callable[[Upstream, ProbeResult], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pool = pool
        self.client = client  # the gateway's, once it started
        # (release, variant) -> the variant's golden answers (None: none recorded); a
        # cheaper tier's replicas serve another variant than the release's own.
        self.reference = reference
        self.headers = headers or {}
        self.on_drift = on_drift
        self.clock = clock
        self.results: dict[str, ProbeResult] = {}  # endpoint id -> its last probe
        self.num_probes: dict[tuple[str, str], int] = {}  # (release, outcome) -> count
        self._models: dict[str, str] = {}  # endpoint id -> served model name

    async def run(self) -> None:
        while True:
            await self.probe_due()
            await asyncio.sleep(TICK_S)

    async def probe_due(self) -> None:
        """Probe every ready replica never probed, or last probed `interval_s` ago."""
        now = self.clock()
        live = {u.endpoint_id for u in self.pool}
        for endpoint_id in [e for e in self.results if e not in live]:  # replica gone
            del self.results[endpoint_id]
            self._models.pop(endpoint_id, None)
        due = [
            u
            for u in self.pool
            if u.is_healthy
            and not u.is_draining
            and (
                u.endpoint_id not in self.results
                or now - self.results[u.endpoint_id].at >= self.config.interval_s
            )
        ]
        await asyncio.gather(*(self.probe(u) for u in due))

    async def probe(self, upstream: Upstream) -> ProbeResult | None:
        reference = self.reference(upstream.release, upstream.variant)
        client = self.client()
        if reference is None or client is None:
            return None
        try:
            model = await self._model(client, upstream)
            answers = [
                await golden.ask(client, upstream.url, model, ref.prompt, self.headers)
                for ref in reference
            ]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            # Not a verdict on quality: the request path's breakers and health checks judge
            # a replica that does not answer. Probed again next interval.
            logger.info("drift probe of %s failed: %s", upstream.endpoint_id, exc)
            self._count(upstream.release, "error")
            self.results[upstream.endpoint_id] = ProbeResult(
                upstream.release, upstream.variant, str(upstream.track),
                golden.Agreement(float("nan"), float("nan")), self.clock(),
            )  # fmt: skip
            return None
        result = ProbeResult(
            upstream.release,
            upstream.variant,
            str(upstream.track),
            golden.compare(reference, answers),
            self.clock(),
        )
        self.results[upstream.endpoint_id] = result
        drifted = result.drifted(self.config.min_agreement)
        self._count(upstream.release, "drift" if drifted else "ok")
        if drifted:
            logger.warning(
                "quality drift on %s (release %s, %s): %.1f%% of the golden answers "
                "reproduced, below %.0f%%",
                upstream.endpoint_id, upstream.release, upstream.variant,
                100 * result.agreement.tokens, 100 * self.config.min_agreement,
            )  # fmt: skip
            if self.on_drift is not None:
                self.on_drift(upstream, result)
        return result

    async def _model(self, client: httpx.AsyncClient, upstream: Upstream) -> str:
        model = self._models.get(upstream.endpoint_id)
        if model is None:
            response = await client.get(
                f"{upstream.url}/v1/models", headers=self.headers, timeout=30
            )
            response.raise_for_status()
            model = self._models[upstream.endpoint_id] = response.json()["data"][0]["id"]
        return model

    def _count(self, release: str, outcome: str) -> None:
        key = (release, outcome)
        self.num_probes[key] = self.num_probes.get(key, 0) + 1

    def collect(self) -> Iterator:
        agreement = GaugeMetricFamily(
            PREFIX + "drift_agreement",
            "Share of the release's golden answers the replica reproduced at its last probe "
            "(1: identical to what select recorded).",
            labels=["endpoint", "release", "variant", "track"],
        )
        alert = GaugeMetricFamily(
            PREFIX + "drift_alert",
            "1 when the replica's last probe agreed less than drift_probe.min_agreement.",
            labels=["endpoint", "release", "variant", "track"],
        )
        for endpoint_id, result in sorted(self.results.items()):
            labels = [endpoint_id, result.release, result.variant, result.track]
            agreement.add_metric(labels, result.agreement.tokens)
            alert.add_metric(labels, 1.0 if result.drifted(self.config.min_agreement) else 0.0)
        probes = CounterMetricFamily(
            PREFIX + "drift_probes",
            "Drift probes by release and outcome (ok, drift, error).",
            labels=["release", "outcome"],
        )
        for (release, outcome), count in sorted(self.num_probes.items()):
            probes.add_metric([release, outcome], count)
        yield agreement
        yield alert
        yield probes
