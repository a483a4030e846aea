"""The gateway's request path: authenticate, limit, admit, split, route, forward, account.

One `GatewayService` per gateway process. Every request that gets past authentication
(`auth.py`) holds a tenant concurrency slot and an admission slot until its response ends,
however it ends; `RequestHold.end` (`accounting.py`) gives both back exactly once and
records the request's metrics. A client that hangs up ends its request at once (status
499): the replica's work is cancelled and nothing is held for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import httpx
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from modelship.gateway.accounting import Accounting, RequestHold
from modelship.gateway.adapters import Action, fan_out
from modelship.gateway.admission import AdmissionQueue
from modelship.gateway.auth import GatewayAuth
from modelship.gateway.canary import Track
from modelship.gateway.canary_split import CanarySplit
from modelship.gateway.config import GatewayConfig
from modelship.gateway.cost import Price
from modelship.gateway.forwarding import Forwarder, unless_client_gone
from modelship.gateway.groups import STABLE, Group, model_group, tier_group
from modelship.gateway.metrics import FleetSnapshot, GatewayMetrics, pool_snapshot
from modelship.gateway.models import ModelCatalog
from modelship.gateway.pool import EndpointPool, HealthChecker
from modelship.gateway.request import (
    GatewayError,
    ParsedRequest,
    parse_request,
    refused,
    requested_tier,
    unavailable,
)
from modelship.gateway.tenant_state import create_tenant_state
from modelship.gateway.tenants import Tenant
from modelship.gateway.tiers import PRIMARY, TierDecision, TierLoad, TierNeed, choose_tier
from modelship.request_id import REQUEST_ID_HEADER, request_id_from
from modelship.tracing import Span, SpanKind, Tracing, client_links, end_span

logger = logging.getLogger(__name__)


class GatewayService:
    def __init__(
        self,
        config: GatewayConfig,
        pool: EndpointPool,
        *,
        api_key: str | None = None,
        upstream_api_key: str | None = None,
        canary_weight: int = 0,
        fleet_snapshot: Callable[[], FleetSnapshot] | None = None,
        tracing: Tracing | None = None,
        access_log: bool = False,
        catalog: ModelCatalog | None = None,
    ) -> None:
        """`catalog`: the models served (`models.py`); None: one model, named by nobody."""
        self.config = config
        self.catalog = catalog or ModelCatalog()
        self.tracing = tracing or Tracing()  # off unless configured: spans cost nothing
        self.pool = pool
        self.auth = GatewayAuth(config, api_key)
        self.admission = AdmissionQueue(config.admission)
        self.served_tiers = [PRIMARY, *(tier.name for tier in config.tiers)]
        self.tier_models = {tier.name: tier.model for tier in config.tiers if tier.model}
        # The local fleet's: adapters changed on the replicas it runs and those it starts.
        self.on_change_adapters: (
            Callable[[Action, dict[str, str]], Awaitable[tuple[int, dict]]] | None
        ) = None
        self.upstream_headers = {"content-type": "application/json"}
        if upstream_api_key:
            self.upstream_headers["authorization"] = f"Bearer {upstream_api_key}"
        self.metrics = GatewayMetrics(fleet_snapshot or self.snapshot)
        self.tenant_state = create_tenant_state(config, self.metrics)
        self.canary = CanarySplit(config.canary, pool, self.metrics, canary_weight,
                                  num_tenants=len(config.tenants))  # fmt: skip
        self.forwarder = Forwarder(config, pool, self.metrics, self.tracing,
                                   self.upstream_headers, bool(upstream_api_key),
                                   self.canary.record, self.auth.says_release,
                                   self.catalog)  # fmt: skip
        prices = {
            name: Price(p.input_per_1k, p.output_per_1k) for name, p in config.cost.variants.items()
        }
        self.accounting = Accounting(self.tenant_state, self.admission, self.metrics, prices,
                                     access_log=access_log)  # fmt: skip
        self.is_draining = False
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        self.shared = None  # with gateway.state: the other gateway replicas' decisions' inputs
        if config.state is not None:
            from modelship.gateway.shared_decisions import SharedDecisions  # client if used

            self.shared = SharedDecisions(config.state, self.tier_in_flight,
                                          self.metrics.state_failures)  # fmt: skip

    # Lifecycle ---------------------------------------------------------------------------
    async def start(self, health_checks: bool = True) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        transport = httpx.AsyncHTTPTransport(limits=limits)
        # trust_env off: replicas are never reached through an HTTP_PROXY of the environment
        # (the requests sent on the transport never were).
        self.client = httpx.AsyncClient(transport=transport, timeout=None, trust_env=False)
        self.forwarder.transport = transport  # requests to replicas are sent on it directly
        if health_checks:
            checker = HealthChecker(self.pool, self.client)
            # Before listening (the app's startup runs first): a gateway restarted under load
            # answered its first requests 503, its replicas not yet checked.
            await checker.check_all()
            self._health_task = asyncio.create_task(checker.run())
        if self.shared is not None:
            if self.config.canary.split_secret is None:
                secret = await self.shared.split_secret()
                if secret is not None:
                    self.canary.share_secret(secret)
            if self.config.tiers:  # brown-out's load: nothing to share without tiers
                await self.shared.start()

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self.shared is not None:
            await self.shared.close()
        if self.client is not None:
            await self.client.aclose()
        await self.tenant_state.close()
        self.tracing.shutdown()

    @property
    def num_held(self) -> int:
        return self.admission.num_held

    def is_ready(self) -> bool:
        return not self.is_draining and self.pool.has_routable(STABLE)

    def snapshot(self) -> FleetSnapshot:
        """Fleet gauges from the pool alone (static endpoints; `up` passes a richer one)."""
        held = self.admission.num_held_by_priority()
        return pool_snapshot(self.pool, held, self.canary.weight)

    # Request path ------------------------------------------------------------------------
    async def change_adapters(self, action: Action, body: dict[str, str]) -> tuple[int, dict]:
        """Load or unload an adapter on every replica (`adapters.fan_out`), or through
        `on_change_adapters` (the local fleet's, which also covers replicas it starts)."""
        if self.on_change_adapters is not None:
            return await self.on_change_adapters(action, body)
        assert self.client is not None
        replicas = [(u.endpoint_id, u.url) for u in self.pool]
        done = await fan_out(self.client, replicas, action, body, self.upstream_headers,
                             self.config.resilience.request_timeout_s)  # fmt: skip
        return done.status_code, done.body

    async def handle(self, request: Request) -> Response:
        """POST /v1/chat/completions and /v1/completions."""
        request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
        tenant_name = "unknown"
        span = self.tracing.start_span(
            "gateway request",
            None,  # a new trace: a client's traceparent is only linked (`tracing.py`)
            {"request_id": request_id, "path": request.url.path},
            kind=SpanKind.SERVER,
            links=client_links(request.headers) if self.tracing.is_enabled else (),
        )
        try:
            tenant = self.auth.authenticate(request)
            tenant_name = tenant.name
            if self.is_draining:
                raise unavailable("the gateway is shutting down; retry shortly")
            raw = await request.body()
            parsed = parse_request(
                raw,
                request.url.path,
                request.headers.get("x-session-id"),
                self.config.request_limits,
            )
            parsed.requested_tier = requested_tier(request.headers, self.served_tiers)
            if tenant.may_use(parsed.model):  # else refused as not allowed (403), not 404
                parsed.served_model = self.catalog.resolve(parsed.model)
            hold = await self._admit(tenant, parsed, request_id, span)
        except GatewayError as error:
            self.metrics.requests.labels(tenant_name, str(error.status_code), "none", "none").inc()
            end_span(span, {"tenant": tenant_name, "status": error.status_code})
            return error.response(request_id)
        except ClientDisconnect:  # gone before its body arrived
            self.metrics.requests.labels(tenant_name, "499", "none", "none").inc()
            end_span(span, {"tenant": tenant_name, "status": 499})
            return Response(status_code=499)
        try:
            forward = self._forward(request.url.path, parsed, tenant, hold, request_id)
            return await unless_client_gone(request, forward, hold)
        except GatewayError as error:
            hold.end(error.status_code, None)
            return error.response(request_id)
        except BaseException:
            hold.end(500, None)
            raise

    async def _admit(
        self, tenant: Tenant, parsed: ParsedRequest, request_id: str, span: Span
    ) -> RequestHold:
        # A text's token count is the replica's to check (exactly) when it trusts us.
        check_max_input = parsed.input_is_exact or not self.forwarder.replicas_trust_gateway
        limit = await self.tenant_state.admit(tenant, parsed.model, parsed.input_tokens,
                                              parsed.max_tokens, parsed.num_sequences,
                                              check_max_input)  # fmt: skip
        if not limit.ok:
            code = str(limit.reason)
            self.metrics.rejections.labels(tenant.name, code).inc()
            raise refused(limit.status_code, limit.message, code, limit.retry_after_s, limit.param)
        admitted = self.admission.try_admit(tenant.priority, parsed.num_sequences)
        if not admitted.ok:
            self.tenant_state.settle(tenant, limit, -limit.num_reserved_tokens,
                                     parsed.num_sequences)  # fmt: skip
            self.metrics.rejections.labels(tenant.name, admitted.reason or "queue_full").inc()
            if admitted.status_code == 400:
                raise GatewayError(400, admitted.message, code=admitted.reason)
            raise unavailable(admitted.message, admitted.retry_after_s or 1.0)
        if limit.max_tokens is not None and parsed.max_tokens is None:
            parsed.set("max_tokens", limit.max_tokens)
            parsed.max_tokens = limit.max_tokens
        parsed.set("priority", int(tenant.priority))  # the tenant's class, not the client's
        return RequestHold(self.accounting, tenant, parsed.num_sequences, parsed.input_tokens,
                           limit, time.perf_counter(), request_id,
                           parsed.model or "default", span)  # fmt: skip

    def pick_group(self, parsed: ParsedRequest, tenant: Tenant, request_id: str) -> Group:
        """The group that serves the request: another model's stable group, else (the
        primary model) its tier, then for the primary tier the canary split's track."""
        if parsed.served_model is not None:
            return model_group(parsed.served_model)
        tier = self.pick_tier(parsed, tenant).tier
        if tier != PRIMARY:
            return self.tier_group(tier, parsed)
        return Group(self.pick_track(parsed, tenant, request_id))

    def pick_tier(self, parsed: ParsedRequest, tenant: Tenant) -> TierDecision:
        """Which tier serves the request (`tiers.choose_tier`), counted by tier and reason;
        the primary's load is its stable track's (a canary's share is small and judged on
        its own)."""
        config = self.config
        if not config.tiers:
            self.metrics.tier_decisions.labels(PRIMARY, "default").inc()
            return TierDecision(PRIMARY, "default")
        others = self.shared.others if self.shared is not None else {}
        loads = {}
        for name in self.served_tiers:  # every gateway replica's requests (`shared`)
            load = self.pool.load(self.tier_group(name))
            loads[name] = TierLoad(load.routable, load.in_flight + others.get(name, 0))
        need = TierNeed(tenant.priority, parsed.max_tokens, parsed.input_tokens,
                        parsed.requested_tier)  # fmt: skip
        decision = choose_tier(config.tiers, config.tier_rules, config.brownout, need,
                               tenant.config, loads)  # fmt: skip
        self.metrics.tier_decisions.labels(decision.tier, decision.reason).inc()
        return decision

    def tier_in_flight(self) -> dict[str, int]:
        """This gateway's requests in flight on each tier (what brown-out counts)."""
        if not self.config.tiers:
            return {}
        return {name: self.pool.in_flight(self.tier_group(name)) for name in self.served_tiers}

    def tier_group(self, tier: str, parsed: ParsedRequest | None = None) -> Group:
        """The group serving `tier`: a model tier's model's stable group (and `parsed`, the
        request it serves, then asks for that model), else the tier's own."""
        model = self.tier_models.get(tier)
        if model is None:
            return tier_group(tier)
        if parsed is not None:
            parsed.model_tier = tier
        return model_group(model)

    def pick_track(self, parsed: ParsedRequest, tenant: Tenant, request_id: str) -> Track:
        """The canary split's track (`CanarySplit.pick_track`) for the tenant's session (or
        user, or conversation), else for this request alone."""
        return self.canary.pick_track(tenant.name, parsed.sticky_key or request_id)

    async def _forward(
        self, path: str, parsed: ParsedRequest, tenant: Tenant, hold: RequestHold, request_id: str
    ) -> Response:
        """The group that serves the request (`pick_group`), then the forwarder's; the
        stable group of the model asked for is the fallback (a model tier's too)."""
        group = self.pick_group(parsed, tenant, request_id)
        home = model_group(parsed.served_model)
        return await self.forwarder.forward(path, parsed, tenant, hold, request_id, group, home)
