"""`modelship gateway`: the gateway alone, in front of replicas given by address, or found
in the Kubernetes API (`gateway.discovery`: every ready pod behind the engine's headless
Services, as the render writes them), composed from the config as `local.py` composes
`modelship up`'s. Nothing here starts or scales a replica: an address given is fixed, and
unhealthy until its first health check; a discovered pod comes and goes with its
EndpointSlice. Given the storage and the model (`--storage`, `--model`), the gateway is one
member of a fleet sharing the release plan there (`plan_member.py`): the canary weight
follows the plan instead of `--canary-weight`, and the one member holding the leader lease
judges the canary and probes for drift, writing its decisions to the plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette

from modelship.config import ModelshipConfig
from modelship.fleet.plan_member import PlanMember, PlanSource
from modelship.gateway.app import create_gateway_app
from modelship.gateway.config import DiscoveryConfig
from modelship.gateway.cost import UsageLedger, writer_name
from modelship.gateway.discovery import EndpointDiscovery
from modelship.gateway.engines import EngineKind
from modelship.gateway.groups import CANARY, STABLE, tier_group
from modelship.gateway.pool import EndpointPool, static_upstreams
from modelship.gateway.service import GatewayService
from modelship.tracing import Tracing


class GatewaySetupError(ValueError):
    """The replicas given and the config make no gateway; the message says which part."""


@dataclass(frozen=True)
class StaticReplicas:
    """The replicas a standalone gateway routes to (`modelship gateway --endpoint ...`)."""

    stable: list[str]
    canary: list[str] = field(default_factory=list)
    canary_weight: int = 0  # percent of traffic to the canary
    tier_endpoints: list[str] = field(default_factory=list)  # TIER=URL, a gateway.tiers tier's
    engine: str | None = None  # ours or vllm; None: deploy.serving.engine


class StandaloneGateway:
    """The pool of `replicas` and the gateway service in front of it.

    `environment_api_key` is the service key Kubernetes hands the gateway (MODELSHIP_API_KEY):
    the replicas may want it (it wins over serve.api_key for them), and it guards the
    gateway where serve.api_key is unset. Raises `GatewaySetupError`."""

    def __init__(
        self,
        config: ModelshipConfig,
        replicas: StaticReplicas,
        environment_api_key: str | None = None,
        state_url: str | None = None,
        discovery: DiscoveryConfig | None = None,
        usage_dir: Path | None = None,
        plan: PlanSource | None = None,
        lease_s: float = 15.0,
    ) -> None:
        """`state_url`: the tenant quota store (`--state`), over `gateway.state`;
        `discovery`: where to find the replicas (`--discover-service`), over
        `gateway.discovery`, which is used only when no replica is given by address;
        `usage_dir`: the folder of the usage ledger (`--usage-dir`, the model's `usage/` on
        the models volume), where this gateway appends to a file of its own; `plan`: the
        release plan the canary weight follows (`--storage`, `--model`), over
        `replicas.canary_weight`, and the leader lease beside it (`fleet/election.py`,
        lasting `lease_s` seconds unrenewed)."""
        discovery = discovery or (None if replicas.stable else config.gateway.discovery)
        if not replicas.stable and discovery is None:
            raise GatewaySetupError(
                "no replicas: pass --endpoint URL (or set MODELSHIP_GATEWAY_ENDPOINTS), or "
                "--discover-service NAME (or gateway.discovery)"
            )
        if replicas.stable and discovery is not None:
            raise GatewaySetupError("--endpoint and --discover-service: pass one of the two")
        weight = replicas.canary_weight
        has_canary = bool(replicas.canary) or discovery is not None
        if has_canary and not 0 <= weight <= 99:
            raise GatewaySetupError(f"--canary-weight must be 0..99 (percent), got {weight}")
        try:
            kind = EngineKind(replicas.engine or config.deploy.serving.engine)
        except ValueError:
            raise GatewaySetupError(
                f"--engine must be ours or vllm, got {replicas.engine!r}"
            ) from None
        self.pool = EndpointPool(config.gateway.resilience)
        static_upstreams(self.pool, replicas.stable, STABLE, "stable", engine=kind)
        static_upstreams(self.pool, replicas.canary, CANARY, "canary", engine=kind)
        tiers = {tier.name: tier for tier in config.gateway.variant_tiers}
        tier_urls: dict[str, list[str]] = {}
        for item in replicas.tier_endpoints:
            name, _, url = item.partition("=")
            if name not in tiers or not url:
                known = ", ".join(tiers) or "none configured"
                raise GatewaySetupError(
                    f"--tier-endpoint {item!r}: expected TIER=URL with TIER one of "
                    f"gateway.tiers ({known})"
                )
            tier_urls.setdefault(name, []).append(url)
        # The models behind it (`models:`): routed by name; their pods found by label.
        catalog = config.model_catalog(plan.slug if plan is not None else None)
        self.discovery = None
        if discovery is not None:
            self.discovery = EndpointDiscovery(discovery, self.pool, kind, set(tiers),
                                               catalog=catalog)  # fmt: skip
        for name, urls in tier_urls.items():
            variant = tiers[name].variant
            static_upstreams(self.pool, urls, tier_group(name), "stable", variant, kind)
        # Clients authenticate as tenants (or with serve.api_key); the replicas may want the
        # service key.
        upstream_key = environment_api_key or config.serve.api_key
        if config.gateway.tenants and not upstream_key:
            raise GatewaySetupError(
                "gateway.tenants: the replicas need an API key to trust the gateway's "
                "per-tenant settings (prefix-cache namespace, max_input_tokens); without one "
                "tenants would share one prefix cache. Set serve.api_key (or "
                "MODELSHIP_API_KEY) here and on the replicas"
            )
        gateway = config.gateway.bounded_by(config.serve.engine.max_model_len)
        if state_url is not None:
            try:
                gateway = gateway.with_state(state_url)
            except ValueError as exc:
                raise GatewaySetupError(f"--state: {exc}") from None
        self.service = GatewayService(
            gateway,
            self.pool,
            api_key=config.serve.api_key or environment_api_key,
            upstream_api_key=upstream_key,
            canary_weight=weight if has_canary else 0,
            tracing=Tracing(config.tracing, "modelship-gateway"),
            access_log=config.log_format == "json",
            catalog=catalog,
        )
        if self.discovery is not None:  # what it sees, on the public /metrics
            self.service.metrics.fleet_registry.register(self.discovery)
        if usage_dir is not None:
            self.service.accounting.ledger = UsageLedger(usage_dir, writer_name())
        self.plan = None
        if plan is not None:  # follows the plan; the leader among them judges and probes
            self.plan = PlanMember(plan, self.service, lease_s)

    def app(self) -> Starlette:
        starts, stops = [], []
        for part in (self.discovery, self.plan):
            if part is not None:
                starts.append(part.start)
                stops.append(part.stop)
        return create_gateway_app(self.service, on_startup=starts, on_shutdown=stops)
