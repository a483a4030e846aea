"""`modelship up`: the gateway, the supervisor and the replicas of a model, locally (and of
the models served beside it: `models:`, each with its own replicas and autoscaling).

The release plan lives on storage (the `production` link and `traffic.json`); the fleet
reads it every `plan_interval_s` (`plan_follower.py`, as a standalone gateway does) and
points the supervisor's tracks and the gateway's canary weight at it. A canary the
gateway's judge rolls back is ended on storage too, so `modelship release status` tells
the same story as the metrics. The drift probe
(`gateway/drift.py`) compares every replica with its release's `golden.json`; a canary
that drifts is rolled back like one that is slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from pathlib import Path

from starlette.applications import Starlette

from modelship.config import ModelshipConfig
from modelship.fleet.golden_source import evaluated_golden
from modelship.fleet.metrics import FleetMetrics
from modelship.fleet.plan_follower import PlanFollower
from modelship.fleet.supervisor import ReleaseSpec, ReplicaState, Supervisor
from modelship.gateway.adapters import Action, FanOut, fan_out, is_under
from modelship.gateway.app import create_gateway_app
from modelship.gateway.canary import Verdict
from modelship.gateway.cost import USAGE_DIR, UsageLedger, derive_price
from modelship.gateway.drift import DriftProbe, ProbeResult
from modelship.gateway.groups import CANARY, STABLE, model_group, tier_group
from modelship.gateway.pool import EndpointPool, Upstream
from modelship.gateway.request import GatewayError
from modelship.gateway.service import GatewayService
from modelship.pipeline.errors import PipelineError
from modelship.release import golden
from modelship.release.traffic import TrafficPlan, end_canary
from modelship.server.process import ReplicaProcess
from modelship.storage import Storage, StorageError, read_manifest
from modelship.tracing import Tracing

logger = logging.getLogger(__name__)


def no_release_message(storage: Storage, slug: str) -> str:
    """What to run next when there is nothing to serve: select if variants are made."""
    optimized = storage.model_dir(slug) / "optimized"
    made = sorted(p.parent.name for p in optimized.glob("*/manifest.json"))
    if made:
        return (
            f"{slug} has no production release under {storage.root}; its variants "
            f"({', '.join(made)}) are optimized: `modelship select --model {slug}` measures "
            "them and publishes one"
        )
    return (
        f"{slug} has no production release under {storage.root}; `modelship "
        f"optimize --model {slug}` then `select` make one (`modelship run SOURCE`: all)"
    )


class LocalFleet:
    def __init__(
        self, config: ModelshipConfig, storage: Storage, slug: str, plan_interval_s: float = 1.0
    ) -> None:
        if storage.production_release(slug) is None:
            raise PipelineError(no_release_message(storage, slug))
        self.config = config
        self.storage = storage
        self.slug = slug
        self.plan = PlanFollower(storage, slug, self.sync_plan, plan_interval_s)
        self.served_model_name = config.serve.served_model_name or slug
        self.log_dir = storage.model_dir(slug) / "fleet"
        self.pool = EndpointPool(config.gateway.resilience)
        for entry in config.models:  # before serving: a model without a release is an error
            if storage.production_release(entry.name) is None:
                raise PipelineError(
                    f"models: {entry.name} has no production release under {storage.root}; "
                    f"`modelship run` with that model makes one"
                )
        # Replicas trust the gateway's settings (a tenant's prefix-cache namespace and input
        # cap, the failover's resume fields) only from holders of their key: without
        # serve.api_key the fleet makes one up (never stored).
        self.replica_api_key = config.serve.api_key or secrets.token_urlsafe(32)
        self.service = GatewayService(
            config.gateway.bounded_by(config.serve.engine.max_model_len),
            self.pool,
            api_key=config.serve.api_key,
            upstream_api_key=self.replica_api_key,
            fleet_snapshot=lambda: self.supervisor.snapshot(self.service),
            tracing=Tracing(config.tracing, "modelship-gateway"),
            access_log=config.log_format == "json",
            catalog=config.model_catalog(slug),
        )
        self.service.canary.on_rollback = self._auto_rollback
        self.service.on_change_adapters = self._change_adapters
        # Adapters loaded at runtime through the gateway (name -> folder): replicas started
        # from now on get them as `--lora`, like serve.loras.
        self.runtime_loras: dict[str, str] = {}
        self.supervisor = Supervisor(
            config.autoscale,
            self.pool,
            FleetMetrics(self.service.metrics.fleet_registry),
            self._launch,
            tiers=config.gateway.variant_tiers,
            models={e.served_name: e.autoscale or config.autoscale for e in config.models},
        )
        self.supervisor.on_canary_failed = self._canary_failed
        # Before serving: a missing variant is a setup error.
        for tier in config.gateway.variant_tiers:
            folder = storage.variant_dir(slug, tier.variant)
            if not (folder / "manifest.json").is_file():
                raise PipelineError(
                    f"gateway.tiers: tier {tier.name!r} serves variant {tier.variant!r}, but "
                    f"{folder} holds no optimized model; run `modelship optimize` with that "
                    "variant, or fix the name"
                )
        self.drift_probe = DriftProbe(
            config.gateway.drift_probe,
            self.pool,
            lambda: self.service.client,
            self._golden_reference,
            headers=self.service.upstream_headers,
            on_drift=self._drifted,
        )
        self.service.metrics.fleet_registry.register(self.drift_probe)
        self._references: dict[tuple[str, str], list[golden.GoldenAnswer] | None] = {}
        self._priced: set[int] = set()
        self.service.accounting.ledger = UsageLedger(storage.model_dir(slug) / USAGE_DIR)
        self._tasks: list[asyncio.Task] = []

    def _launch(self, spec: ReleaseSpec, replica_id: str) -> ReplicaProcess:
        primary = spec.model is None  # the adapters are the primary model's
        options = self.config.replica_options(
            served_model_name=spec.model or self.served_model_name,
            variant=spec.variant,
            loras={**self.config.serve.loras, **self.runtime_loras} if primary else {},
            # the gateway's admin calls reach every replica
            enable_lora_admin=bool(self.config.gateway.admin_api_key_sha256),
            tracing=self.config.tracing.resolved(),
        )
        return ReplicaProcess(
            spec.model_dir,
            *options.replica_args(),
            log_path=self.log_dir / f"{replica_id}.log",
            host="127.0.0.1",
            die_with_parent=True,
            api_key=self.replica_api_key,  # in its environment: `ps` shows a command line to all
        )

    async def _change_adapters(self, action: Action, body: dict[str, str]) -> tuple[int, dict]:
        """An admin's load or unload, on every replica: those serving now at once, those
        still starting once they are ready (they were launched with the adapters of their
        time). Replicas started afterwards get `runtime_loras` on their command line, so a
        name is never loaded again from another folder (409: unload it first). A load
        that fails anywhere is taken back from the replicas this call loaded it on."""
        name = body["lora_name"]
        if action == "unload":
            if name in self.config.serve.loras:
                raise GatewayError(409, f"`{name}` is configured in serve.loras; remove it "
                                   "there", param="lora_name", code="conflict")  # fmt: skip
            self.runtime_loras.pop(name, None)
            done = await self._on_every_replica("unload", body)
            return done.status_code, done.body
        if name == self.served_model_name or name in self.config.serve.loras:
            raise GatewayError(409, f"the name `{name}` is already served", param="lora_name",
                               code="conflict")  # fmt: skip
        # The replicas share this machine: links are resolved, and must stay under a root.
        folder = str(Path(body["lora_path"]).resolve())
        roots = [str(Path(root).resolve()) for root in self.config.gateway.adapter_roots]
        if not is_under(folder, roots):
            raise GatewayError(403, f"`lora_path` leads to {folder}, outside gateway."
                               "adapter_roots", "permission_error", param="lora_path",
                               code="forbidden")  # fmt: skip
        known = self.runtime_loras.get(name)
        if known is not None and known != folder:
            raise GatewayError(409, f"the name `{name}` is already served from another "
                               "folder; unload it first", param="lora_name",
                               code="conflict")  # fmt: skip
        self.runtime_loras[name] = folder
        done = await self._on_every_replica("load", {**body, "lora_path": folder})
        if done.status_code != 200:
            if known is None:
                self.runtime_loras.pop(name, None)
            loaded = set(done.replicas_with("loaded"))
            await self._on_every_replica("unload", {"lora_name": name}, only=loaded)
        return done.status_code, done.body

    async def _on_every_replica(
        self, action: Action, body: dict[str, str], only: set[str] | None = None
    ) -> FanOut:
        timeout_s = self.config.gateway.resilience.request_timeout_s
        client, headers = self.service.client, self.service.upstream_headers
        assert client is not None
        serving = (ReplicaState.READY, ReplicaState.STANDBY)
        replicas = [r for r in self.supervisor.replicas if r.state in serving]
        starting = [r for r in self.supervisor.replicas if r.state is ReplicaState.STARTING]
        if only is not None:
            replicas = [r for r in replicas if r.replica_id in only]
            starting = []
            if not replicas:
                return FanOut(200, {}, [])
        deadline = time.monotonic() + self.config.autoscale.replica_start_timeout_s
        while starting and time.monotonic() < deadline:  # launched before this call
            await asyncio.sleep(0.25)
            replicas += [r for r in starting if r.state in serving]
            starting = [r for r in starting if r.state is ReplicaState.STARTING]
        targets = [(r.replica_id, r.process.url) for r in replicas]
        return await fan_out(client, targets, action, body, headers, timeout_s)

    def release_spec(self, release: int) -> ReleaseSpec:
        folder = self.storage.release_dir(self.slug, release)
        variant = read_manifest(folder).extra.get("variant", "unknown")
        if release not in self._priced:
            self._priced.add(release)
            self._derive_prices(folder)
        return ReleaseSpec(release, folder, variant)

    def _derive_prices(self, release_dir: Path) -> None:
        """Prices of the variants select measured for this release, from `cost.replica_hour`
        (a price set in `cost.variants` wins)."""
        replica_hour = self.config.gateway.cost.replica_hour
        if replica_hour is None:
            return
        try:
            metrics = json.loads((release_dir / "production_metrics.json").read_text())
        except (OSError, ValueError):  # a release not published by select: no measurements
            return
        for name, evaluation in (metrics.get("evaluations") or {}).items():
            serving = evaluation.get("serving") or {}
            if name in self.service.accounting.prices or not serving:
                continue
            prompt_tokens = serving.get("prompt_tokens") or self.config.select.prompt_tokens
            try:
                self.service.accounting.prices[name] = derive_price(
                    replica_hour, serving["throughput_tok_s"], prompt_tokens, serving["ttft_s"]
                )
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("no price for variant %s: %s", name, exc)

    def sync_plan(self, plan: TrafficPlan, production: int | None) -> None:
        """Point the tracks and the canary weight at what storage says now."""
        if production is not None:
            self.supervisor.set_target(STABLE, self.release_spec(production))
            for tier in self.config.gateway.variant_tiers:  # the release's cheaper variants
                folder = self.storage.variant_dir(self.slug, tier.variant)
                spec = ReleaseSpec(production, folder, tier.variant)
                self.supervisor.set_target(tier_group(tier.name), spec)
        for entry in self.config.models:  # the other models: their production release
            release = self.storage.production_release(entry.name)
            if release is not None:
                folder = self.storage.release_dir(entry.name, release)
                variant = read_manifest(folder).extra.get("variant", "unknown")
                spec = ReleaseSpec(release, folder, variant, entry.served_name)
                self.supervisor.set_target(model_group(entry.served_name), spec)
        canary = plan.canary
        if canary is None or canary.release == production:
            self.supervisor.set_target(CANARY, None)
            self.service.canary.set_weight(0)
        else:
            self.supervisor.set_target(CANARY, self.release_spec(canary.release))
            self.service.canary.set_weight(canary.weight)

    def _auto_rollback(self, verdict: Verdict) -> None:
        logger.warning(
            "canary auto rollback: %s (stable: %s; canary: %s)",
            verdict.reason, verdict.stable.describe(), verdict.canary.describe(),
        )  # fmt: skip
        end_canary(self.storage, self.slug, verdict.reason, automatic=True)
        self.supervisor.set_target(CANARY, None)

    def _canary_failed(self, reason: str) -> None:
        """The canary's replicas keep dying (or never start): no traffic reaches it, so the
        judge could never roll it back; the supervisor's count does."""
        logger.warning("canary auto rollback: %s", reason)
        target = self.supervisor.groups[CANARY].target
        if target is not None:
            self.service.metrics.canary_rollbacks.labels(str(target.release)).inc()
        end_canary(self.storage, self.slug, reason, automatic=True)
        self.service.canary.set_weight(0)
        self.supervisor.set_target(CANARY, None)

    def _golden_reference(self, release: str, variant: str) -> list[golden.GoldenAnswer] | None:
        """The golden answers select recorded for `variant` in `release` (None: none): the
        release's own variant's in `golden.json`, a cheaper tier's from its evaluation in
        `production_metrics.json` (select measured every variant the same way)."""
        if "/" in release:  # another model's replica (`model/N`): only the primary is probed
            return None
        key = (release, variant)
        if key not in self._references:
            try:
                spec = self.release_spec(int(release))
                if variant == spec.variant:
                    answers = golden.read_reference(spec.model_dir / golden.GOLDEN_FILE)
                else:
                    answers = evaluated_golden(spec.model_dir, variant)
                self._references[key] = answers
            except (OSError, ValueError, KeyError, TypeError, StorageError) as exc:
                logger.warning("release %s, variant %s: golden answers unreadable (%s); not "
                               "probed", release, variant, exc)  # fmt: skip
                self._references[key] = None
        return self._references[key]

    def _drifted(self, upstream: Upstream, result: ProbeResult) -> None:
        probe = self.config.gateway.drift_probe
        if upstream.group != CANARY or not probe.rollback_canary:
            return  # stable has nothing to fall back to: the alert metric is the signal
        self._canary_failed(
            f"quality drift: {upstream.endpoint_id} reproduced {result.agreement.tokens:.0%} "
            f"of the golden answers (minimum {probe.min_agreement:.0%})"
        )

    async def _start(self) -> None:
        self.plan.sync()  # a plan unreadable at start is an error: nothing was serving yet
        self._tasks = [
            asyncio.create_task(self.supervisor.run()),
            asyncio.create_task(self.plan.run()),
        ]
        if self.config.gateway.drift_probe.enabled:
            self._tasks.append(asyncio.create_task(self.drift_probe.run()))

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.supervisor.shutdown()
        if self.service.accounting.ledger is not None:
            self.service.accounting.ledger.close()

    def app(self) -> Starlette:
        return create_gateway_app(self.service, on_startup=[self._start], on_shutdown=[self._stop])
