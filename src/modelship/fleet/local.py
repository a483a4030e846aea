"""`modelship up`: the gateway, the supervisor and the replicas of one model, locally.

The release plan lives on storage (the `production` link and `traffic.json`); the fleet
reads it every `plan_interval_s` and points the supervisor's tracks and the gateway's
canary weight at it. A canary the gateway's judge rolls back is ended on storage too, so
`modelship release status` tells the same story as the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

from starlette.applications import Starlette

from modelship.config import ModelshipConfig
from modelship.fleet.metrics import FleetMetrics
from modelship.fleet.releases import end_canary, read_traffic
from modelship.fleet.supervisor import ReleaseSpec, Supervisor
from modelship.gateway.app import create_gateway_app
from modelship.gateway.canary import Track, Verdict
from modelship.gateway.pool import EndpointPool
from modelship.gateway.service import GatewayService
from modelship.pipeline.errors import PipelineError
from modelship.server.process import ReplicaProcess
from modelship.storage import Storage, read_manifest
from modelship.tracing import Tracing

logger = logging.getLogger(__name__)


class LocalFleet:
    def __init__(
        self, config: ModelshipConfig, storage: Storage, slug: str, plan_interval_s: float = 1.0
    ) -> None:
        if storage.production_release(slug) is None:
            raise PipelineError(
                f"{slug} has no production release under {storage.root}; "
                "run `modelship run` (or `modelship select`) first"
            )
        self.config = config
        self.storage = storage
        self.slug = slug
        self.plan_interval_s = plan_interval_s
        self.served_model_name = config.serve.served_model_name or slug
        self.log_dir = storage.model_dir(slug) / "fleet"
        self.pool = EndpointPool(config.gateway.resilience)
        # Replicas trust a tenant's prefix-cache namespace only from holders of their key,
        # so tenants need one: without serve.api_key the fleet makes one up (never stored).
        self.replica_api_key = config.serve.api_key or (
            secrets.token_urlsafe(32) if config.gateway.tenants else None
        )
        self.service = GatewayService(
            config.gateway,
            self.pool,
            api_key=config.serve.api_key,
            upstream_api_key=self.replica_api_key,
            fleet_snapshot=lambda: self.supervisor.snapshot(self.service),
            tracing=Tracing(config.tracing, "modelship-gateway"),
            access_log=config.log_format == "json",
        )
        self.service.on_canary_rollback = self._auto_rollback
        self.supervisor = Supervisor(
            config.autoscale, self.pool, FleetMetrics(self.service.metrics.registry), self._launch
        )
        self.supervisor.on_canary_failed = self._canary_failed
        self._tasks: list[asyncio.Task] = []

    def _launch(self, spec: ReleaseSpec, replica_id: str) -> ReplicaProcess:
        serve = self.config.serve
        limits = self.config.gateway.request_limits  # replicas check the gateway's caps
        args = [
            *serve.engine.cli_args(),
            "--served-model-name", self.served_model_name,
            "--variant", spec.variant,
            "--grace-period", str(serve.grace_period_s),
            "--stall-timeout", str(serve.stall_timeout_s),
            "--max-n", str(limits.max_n),
            "--max-stop", str(limits.max_stop),
            "--max-stop-chars", str(limits.max_stop_chars),
            "--max-prompts", str(limits.max_prompts),
            "--max-body-mb", str(limits.max_body_mb),
            "--log-format", self.config.log_format,
            *self.config.tracing.cli_args(),
        ]  # fmt: skip
        return ReplicaProcess(
            spec.model_dir,
            *args,
            log_path=self.log_dir / f"{replica_id}.log",
            host="127.0.0.1",
            die_with_parent=True,
            api_key=self.replica_api_key,  # in its environment: `ps` shows a command line to all
        )

    def release_spec(self, release: int) -> ReleaseSpec:
        folder = self.storage.release_dir(self.slug, release)
        variant = read_manifest(folder).extra.get("variant", "unknown")
        return ReleaseSpec(release, folder, variant)

    def sync_plan(self) -> None:
        """Point the tracks and the canary weight at what storage says now."""
        production = self.storage.production_release(self.slug)
        if production is not None:
            self.supervisor.set_target(Track.STABLE, self.release_spec(production))
        canary = read_traffic(self.storage, self.slug).canary
        if canary is None or canary.release == production:
            self.supervisor.set_target(Track.CANARY, None)
            self.service.set_canary_weight(0)
        else:
            self.supervisor.set_target(Track.CANARY, self.release_spec(canary.release))
            self.service.set_canary_weight(canary.weight)

    def _auto_rollback(self, verdict: Verdict) -> None:
        logger.warning(
            "canary auto rollback: %s (stable: %s; canary: %s)",
            verdict.reason, verdict.stable.describe(), verdict.canary.describe(),
        )  # fmt: skip
        end_canary(self.storage, self.slug, verdict.reason, automatic=True)
        self.supervisor.set_target(Track.CANARY, None)

    def _canary_failed(self, reason: str) -> None:
        """The canary's replicas keep dying (or never start): no traffic reaches it, so the
        judge could never roll it back; the supervisor's count does."""
        logger.warning("canary auto rollback: %s", reason)
        target = self.supervisor.tracks[Track.CANARY].target
        if target is not None:
            self.service.metrics.canary_rollbacks.labels(str(target.release)).inc()
        end_canary(self.storage, self.slug, reason, automatic=True)
        self.service.set_canary_weight(0)
        self.supervisor.set_target(Track.CANARY, None)

    async def _plan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.plan_interval_s)
            try:
                self.sync_plan()
            except Exception:  # a half-edited plan must not stop the fleet
                logger.exception("reading the release plan failed; keeping the current one")

    async def _start(self) -> None:
        self.sync_plan()
        self._tasks = [
            asyncio.create_task(self.supervisor.run()),
            asyncio.create_task(self._plan_loop()),
        ]

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.supervisor.shutdown()

    def app(self) -> Starlette:
        return create_gateway_app(self.service, on_startup=[self._start], on_shutdown=[self._stop])
