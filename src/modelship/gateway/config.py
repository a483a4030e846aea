"""The `gateway:` section of pipeline.yaml: tenants, routing, resilience, canary judging.

Errors never echo input (`hide_input_in_errors`): a tenant's key pasted where its sha256
belongs must not reach a terminal or a log.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from modelship.gateway.admission import AdmissionConfig
from modelship.gateway.routing import create_router, supported_routers
from modelship.gateway.tenants import TenantConfig
from modelship.gateway.tiers import PRIMARY, BrownoutConfig, TierConfig, TierRule, check_tiers

STATE_SCHEMES = ("redis", "rediss", "unix")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class RoutingConfig(_Section):
    policy: str = "prefix_affinity"
    # Keyword options of the policy, e.g. {load_factor: 1.25, block_chars: 64}.
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _buildable(self) -> RoutingConfig:
        if self.policy not in supported_routers():
            raise ValueError(
                f"unknown policy {self.policy!r}; supported: {', '.join(supported_routers())}"
            )
        create_router(self.policy, **self.options)  # raises ValueError naming the option
        return self


class ResilienceConfig(_Section):
    # Retries to another replica: connect errors, 503, and a replica that broke the
    # connection before any byte reached the client.
    max_attempts: int = Field(default=3, ge=1)
    base_backoff_s: float = Field(default=0.02, ge=0)
    max_backoff_s: float = Field(default=0.5, ge=0)
    # Mid-stream failover: replicas tried to resume a stream whose replica failed after
    # its first byte (0: such a stream ends with an error event).
    max_failovers: int = Field(default=2, ge=0)
    # Circuit breaker per replica.
    breaker_failure_threshold: int = Field(default=3, ge=1)
    breaker_cool_down_s: float = Field(default=5.0, ge=0)
    # Passive outlier detection (error rate over a window).
    outlier_window_s: float = Field(default=30.0, gt=0)
    outlier_min_requests: int = Field(default=10, ge=1)
    outlier_max_error_rate: float = Field(default=0.5, gt=0, le=1)
    outlier_ejection_s: float = Field(default=30.0, ge=0)
    # Timeouts: connecting, the first byte of a response, and the whole request.
    connect_timeout_s: float = Field(default=2.0, gt=0)
    first_byte_timeout_s: float = Field(default=120.0, gt=0)
    request_timeout_s: float = Field(default=600.0, gt=0)
    # Active checks: /ready of every replica, and its /metrics for load.
    health_check_interval_s: float = Field(default=1.0, gt=0)
    metrics_scrape_interval_s: float = Field(default=2.0, gt=0)


class CanaryJudgeConfig(_Section):
    """How traffic is split, and when a canary is rolled back on its own: compared with
    stable over `window_s`."""

    # Keys the sticky split (tenant + session), so no client can compute which session id
    # lands on which track. Unset: a random one per gateway process (set one shared value
    # when several gateways must split a session the same way).
    split_secret: str | None = Field(default=None, min_length=16)
    auto_rollback: bool = True
    window_s: float = Field(default=120.0, gt=0)
    min_requests: int = Field(default=20, ge=1)  # per track, before judging at all
    # Rolled back when canary error rate > stable error rate + margin ...
    max_error_rate_margin: float = Field(default=0.05, ge=0, le=1)
    # ... or canary TTFT p95 > stable TTFT p95 x ratio, and higher by at least
    # `min_ttft_increase_s` (a few ms more on a fast model is noise, not a regression).
    max_ttft_p95_ratio: float = Field(default=1.5, ge=1)
    min_ttft_increase_s: float = Field(default=0.05, ge=0)


class DriftProbeConfig(_Section):
    """The quality-drift probe (`gateway/drift.py`, run by `modelship up`, and by the leader
    among gateways sharing a release plan, `fleet/plan_member.py`): each replica is
    asked the release's golden prompts when it becomes ready and every `interval_s` after;
    agreement below `min_agreement` raises the alert metric, and rolls a canary back."""

    enabled: bool = True
    interval_s: float = Field(default=300.0, gt=0)
    min_agreement: float = Field(default=0.9, ge=0, le=1)
    rollback_canary: bool = True


class PriceConfig(_Section):
    input_per_1k: float = Field(ge=0)
    output_per_1k: float = Field(ge=0)


class CostConfig(_Section):
    """Prices per 1k tokens (`gateway/cost.py`): set per variant in `variants`, or derived
    for every variant select measured from what one replica costs per hour."""

    replica_hour: float | None = Field(default=None, ge=0)
    currency: str = "USD"
    variants: dict[str, PriceConfig] = Field(default_factory=dict)


class RequestLimitsConfig(_Section):
    """What one request may ask for, checked before it is admitted (the replicas check the
    same caps): sequences per prompt (`n`), stop strings, prompts, token ids per prompt."""

    max_n: int = Field(default=16, ge=1)
    max_stop: int = Field(default=16, ge=1)  # stop strings per request
    max_stop_chars: int = Field(default=256, ge=1)  # characters per stop string
    max_prompts: int = Field(default=64, ge=1)  # prompts per completion request
    max_body_mb: int = Field(default=16, ge=1)  # request body, refused with 413 beyond
    # Token ids per prompt (the replicas' max_model_len); `modelship up` and `modelship
    # gateway` set it from serve.engine.max_model_len (`bounded_by`). Unset: the replicas
    # alone refuse longer ones.
    max_prompt_tokens: int | None = Field(default=None, ge=1)


class DiscoveryConfig(_Section):
    """Replicas found in the Kubernetes API (`gateway/discovery.py`): the ready endpoints of
    the EndpointSlices of these headless Services, each pod one upstream."""

    services: list[str] = Field(min_length=1)
    # Unset: the gateway pod's own namespace (its service account's).
    namespace: str | None = None
    # The slice port the replicas serve on, by name (a slice with one port: that one).
    port: str = "http"
    # The API server's URL; unset: in-cluster, with the pod's service account token.
    api_server: str | None = None

    @field_validator("services", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


class GatewayConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    # No tenants: the gateway is open (or guarded by serve.api_key as one tenant).
    tenants: list[TenantConfig] = Field(default_factory=list)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    resilience: ResilienceConfig = Field(default_factory=ResilienceConfig)
    canary: CanaryJudgeConfig = Field(default_factory=CanaryJudgeConfig)
    drift_probe: DriftProbeConfig = Field(default_factory=DriftProbeConfig)
    cost: CostConfig = Field(default_factory=CostConfig)
    request_limits: RequestLimitsConfig = Field(default_factory=RequestLimitsConfig)
    # Precision tiers served beside the production release (`gateway/tiers.py`), best to
    # cheapest; the rules that send requests to them; and the brown-out under overload.
    tiers: list[TierConfig] = Field(default_factory=list)
    tier_rules: list[TierRule] = Field(default_factory=list)
    brownout: BrownoutConfig = Field(default_factory=BrownoutConfig)
    # Output length assumed for a request before any has finished (token-aware routing).
    initial_output_tokens: int = Field(default=128, ge=0)
    # Keys (sha256 digests) that read /metrics with its tenant series; anyone else gets
    # every series summed over tenants, so no tenant's name or usage is public.
    metrics_api_key_sha256: list[str] = Field(default_factory=list)
    # Keys (sha256 digests) that may load and unload LoRA adapters on every replica at
    # runtime (`gateway/adapters.py`); none: those routes answer 404.
    admin_api_key_sha256: list[str] = Field(default_factory=list)
    # Folders (absolute, as the replicas see them) adapters may be loaded from through the
    # gateway; none: loading is refused (unloading still works).
    adapter_roots: list[str] = Field(default_factory=list)
    # Where tenants' quotas (requests/min, tokens/min, concurrency) are kept
    # (`gateway/tenant_state.py`): None, in each gateway process (N gateway replicas admit
    # N budgets); a Redis-protocol URL (redis://, rediss://, unix://), shared by every
    # gateway replica. `modelship gateway --state` / MODELSHIP_GATEWAY_STATE override it.
    state: str | None = None
    # The store not answering: refuse quota'd requests (503) or admit them unmetered.
    state_failure: Literal["open", "closed"] = "closed"
    # Where `modelship gateway` finds its replicas when none are given by address: the
    # EndpointSlices of headless Services (`modelship gateway --discover-service`).
    discovery: DiscoveryConfig | None = None

    @field_validator("metrics_api_key_sha256", "admin_api_key_sha256", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("metrics_api_key_sha256", "admin_api_key_sha256")
    @classmethod
    def _hex_digests(cls, digests: list[str], info: ValidationInfo) -> list[str]:
        if not all(re.fullmatch(r"[0-9a-f]{64}", digest) for digest in digests):
            # Never echo the value: it might be a pasted key instead of its hash.
            raise ValueError(
                f"{info.field_name} takes lowercase sha256 hex digests (64 characters), "
                "e.g. from `printf %s KEY | sha256sum`"
            )
        return digests

    @field_validator("adapter_roots")
    @classmethod
    def _absolute_roots(cls, roots: list[str]) -> list[str]:
        for root in roots:
            if not root.startswith("/"):
                raise ValueError(f"{root!r} is not an absolute path")
        return [posixpath.normpath(root) for root in roots]

    @field_validator("state")
    @classmethod
    def _state_url(cls, url: str | None) -> str | None:
        if url is not None:
            # Only the scheme is named: the URL may hold the store's password.
            scheme = urlsplit(url).scheme
            if scheme not in STATE_SCHEMES:
                raise ValueError(
                    f"expected a Redis URL ({', '.join(s + '://' for s in STATE_SCHEMES)}), "
                    f"got scheme {scheme!r}"
                )
        return url

    @field_validator("tenants")
    @classmethod
    def _unique(cls, tenants: list[TenantConfig]) -> list[TenantConfig]:
        from modelship.gateway.tenants import TenantRegistry

        TenantRegistry(tenants)  # names and key digests unique; the error names the tenant
        return tenants

    @model_validator(mode="after")
    def _tiers_consistent(self) -> GatewayConfig:
        check_tiers(self.tiers, self.tier_rules)
        served = [PRIMARY, *(tier.name for tier in self.tiers)]
        for tenant in self.tenants:
            for name in tenant.may_request_tiers:
                if name not in served:
                    raise ValueError(
                        f"tenant {tenant.name!r}: may_request_tiers names tier {name!r}; "
                        f"configured: {', '.join(served)}"
                    )
        return self

    @property
    def variant_tiers(self) -> list[TierConfig]:
        """The tiers run by replicas of their own (a variant's): not the model tiers, whose
        replicas are another model's."""
        return [tier for tier in self.tiers if tier.variant is not None]

    def bounded_by(self, max_model_len: int | None) -> GatewayConfig:
        """This config with `request_limits.max_prompt_tokens` from the replicas'
        max_model_len, where it is set and the config names no bound of its own: a longer
        prompt of token ids is refused before routing."""
        limits = self.request_limits
        if max_model_len is None or limits.max_prompt_tokens is not None:
            return self
        bounded = limits.model_copy(update={"max_prompt_tokens": max_model_len})
        return self.model_copy(update={"request_limits": bounded})

    def with_state(self, url: str) -> GatewayConfig:
        """This config with its tenant quotas in the store at `url` (checked as
        `gateway.state`; raises ValueError naming only the scheme)."""
        return self.model_copy(update={"state": GatewayConfig._state_url(url)})
