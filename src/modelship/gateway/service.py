"""The gateway's request path: authenticate, limit, admit, split, route, forward, account.

One `GatewayService` per gateway process. Every request that gets past authentication
(`auth.py`) holds a tenant concurrency slot and an admission slot until its response ends,
however it ends; `RequestHold.end` (`accounting.py`) gives both back exactly once and
records the request's metrics. A client that hangs up ends its request at once (status
499): the replica's work is cancelled and nothing is held for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

import httpx
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from modelship.gateway.accounting import Accounting, RequestHold
from modelship.gateway.adapters import Action, fan_out
from modelship.gateway.admission import AdmissionQueue
from modelship.gateway.auth import GatewayAuth
from modelship.gateway.canary import CanaryJudge, Track, Verdict, in_canary, judged_ttft
from modelship.gateway.config import GatewayConfig
from modelship.gateway.cost import Price
from modelship.gateway.endpoint import NoEndpointError, OutputLengthEstimator, RoutingRequest
from modelship.gateway.engine_load import ReplicaEngine
from modelship.gateway.engines import UpstreamBodies
from modelship.gateway.failover import FailoverOutcome, StreamProgress, can_fail_over
from modelship.gateway.metrics import FleetSnapshot, GatewayMetrics
from modelship.gateway.pool import EndpointPool, HealthChecker, Upstream
from modelship.gateway.proxy import (
    Attempt,
    Resume,
    StreamEnd,
    pump,
    raise_for_final,
    send_attempt,
)
from modelship.gateway.request import (
    GatewayError,
    ParsedRequest,
    parse_request,
    unavailable,
)
from modelship.gateway.resilience import BreakerState, Failure, FailureKind, RetryPolicy
from modelship.gateway.routing import create_router
from modelship.gateway.tenants import (
    Tenant,
    TenantLimiter,
)
from modelship.gateway.tiers import (
    PRIMARY,
    TIER_HEADER,
    TierDecision,
    TierLoad,
    TierNeed,
    choose_tier,
)
from modelship.gateway.usage import StreamUsage, Usage, ask_for_usage
from modelship.replica_headers import CACHE_SALT_HEADER, MAX_INPUT_TOKENS_HEADER
from modelship.request_id import REQUEST_ID_HEADER, request_id_from
from modelship.tracing import Span, SpanKind, Tracing, client_links, end_span, inject

logger = logging.getLogger(__name__)

_REFUSAL_TYPES = {403: "permission_error", 400: "invalid_request_error", 429: "rate_limit_error"}


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
    ) -> None:
        self.config = config
        self.tracing = tracing or Tracing()  # off unless configured: spans cost nothing
        self.pool = pool
        self.auth = GatewayAuth(config, api_key)
        self.limiter = TenantLimiter()
        self.admission = AdmissionQueue(config.admission)
        resilience = config.resilience
        self.retry_policy = RetryPolicy(
            max_attempts=resilience.max_attempts,
            base_backoff_s=resilience.base_backoff_s,
            max_backoff_s=resilience.max_backoff_s,
            rng=random.Random(),
        )
        self.policy = config.routing.policy
        self.routers = {
            track: create_router(self.policy, **config.routing.options) for track in Track
        }
        # A cheaper tier's replicas (all stable-track) have a router of their own.
        self.tier_routers = {
            tier.name: create_router(self.policy, **config.routing.options) for tier in config.tiers
        }
        self.estimator = OutputLengthEstimator(float(config.initial_output_tokens))
        # Several tenants: no one tenant's requests alone may roll a canary back.
        self.judge = CanaryJudge(config.canary, num_tenants=len(config.tenants))
        self.canary_weight = canary_weight
        secret = config.canary.split_secret
        self.split_secret = hashlib.sha256(secret.encode()).digest() if secret else os.urandom(32)
        # Called once when the judge rolls the canary back (the fleet ends it on storage).
        self.on_canary_rollback: Callable[[Verdict], None] | None = None
        # The local fleet's: adapters changed on the replicas it runs and those it starts.
        self.on_change_adapters: (
            Callable[[Action, dict[str, str]], Awaitable[tuple[int, dict]]] | None
        ) = None
        self.upstream_headers = {"content-type": "application/json"}
        if upstream_api_key:
            self.upstream_headers["authorization"] = f"Bearer {upstream_api_key}"
        self.has_replica_key = bool(upstream_api_key)
        self.metrics = GatewayMetrics(fleet_snapshot or self.snapshot)
        prices = {
            name: Price(p.input_per_1k, p.output_per_1k) for name, p in config.cost.variants.items()
        }
        self.accounting = Accounting(self.limiter, self.admission, self.metrics, prices,
                                     access_log=access_log)  # fmt: skip
        self.is_draining = False
        self.client: httpx.AsyncClient | None = None
        # The client's connection pool; requests to replicas are sent on it directly.
        self.transport: httpx.AsyncHTTPTransport | None = None
        self._health_task: asyncio.Task | None = None

    # Lifecycle ---------------------------------------------------------------------------
    async def start(self, health_checks: bool = True) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        self.transport = httpx.AsyncHTTPTransport(limits=limits)
        # trust_env off: replicas are never reached through an HTTP_PROXY of the environment
        # (the requests sent on the transport never were).
        self.client = httpx.AsyncClient(transport=self.transport, timeout=None, trust_env=False)
        if health_checks:
            checker = HealthChecker(self.pool, self.client)
            # Before listening (the app's startup runs first): a gateway restarted under load
            # answered its first requests 503, its replicas not yet checked.
            await checker.check_all()
            self._health_task = asyncio.create_task(checker.run())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self.client is not None:
            await self.client.aclose()
        self.tracing.shutdown()

    @property
    def replicas_trust_gateway(self) -> bool:
        """Our replicas take the gateway's settings (cache namespace, input cap, failover's
        fields) only with their key (server/gateway_hints.py): without one, or behind vLLM
        (which reads none of them), the gateway checks `max_input_tokens` on its estimate
        and streams never fail over."""
        return self.has_replica_key and self.pool.can_resume()

    @property
    def num_held(self) -> int:
        return self.admission.num_held

    def is_ready(self) -> bool:
        return not self.is_draining and self.pool.has_routable(Track.STABLE)

    def snapshot(self) -> FleetSnapshot:
        """Fleet gauges from the pool alone (static endpoints; `up` passes a richer one)."""
        replicas: dict[tuple[str, str, str, str], int] = {}
        for upstream in self.pool:
            state = "draining" if upstream.is_draining else "ready"
            if not upstream.is_healthy:
                state = "unhealthy"
            key = (str(upstream.track), upstream.release, upstream.variant, state)
            replicas[key] = replicas.get(key, 0) + 1
        return FleetSnapshot(
            replicas=replicas,
            breakers=self.breaker_states(),
            held_by_priority=self.held_by_priority(),
            desired_replicas={},
            canary_weight=self.canary_weight,
            engines=[
                ReplicaEngine(u.endpoint_id, u.variant, u.engine_sample)
                for u in self.pool
                if u.engine_sample is not None
            ],
        )

    def breaker_states(self) -> dict[tuple[str, str], str]:
        return {(u.endpoint_id, u.release): str(u.breaker.state) for u in self.pool}

    def held_by_priority(self) -> dict[str, int]:
        held = self.admission.num_held_by_priority()
        return {priority.name.lower(): count for priority, count in held.items()}

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
            parsed.requested_tier = self._requested_tier(request)
            hold = self._admit(tenant, parsed, request_id, span)
        except GatewayError as error:
            self.metrics.requests.labels(tenant_name, str(error.status_code), "none", "none").inc()
            end_span(span, {"tenant": tenant_name, "status": error.status_code})
            return error.response(request_id)
        except ClientDisconnect:  # gone before its body arrived
            self.metrics.requests.labels(tenant_name, "499", "none", "none").inc()
            end_span(span, {"tenant": tenant_name, "status": 499})
            return Response(status_code=499)
        try:
            return await self._forward_while_connected(request, parsed, tenant, hold, request_id)
        except GatewayError as error:
            hold.end(error.status_code, None)
            return error.response(request_id)
        except BaseException:
            hold.end(500, None)
            raise

    async def _forward_while_connected(
        self,
        request: Request,
        parsed: ParsedRequest,
        tenant: Tenant,
        hold: RequestHold,
        request_id: str,
    ) -> Response:
        """`_forward`, cancelled if the client hangs up before the response starts (once a
        stream is under way, Starlette cancels it the same way)."""
        forward = asyncio.ensure_future(
            self._forward(request.url.path, parsed, tenant, hold, request_id)
        )
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({forward, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not forward.done():
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forward
                hold.end(499, None)
        if forward.cancelled():
            return Response(status_code=499)  # nobody reads it
        return forward.result()

    def _admit(
        self, tenant: Tenant, parsed: ParsedRequest, request_id: str, span: Span
    ) -> RequestHold:
        now = time.monotonic()
        # A text's token count is the replica's to check (exactly) when it trusts us.
        check_max_input = parsed.input_is_exact or not self.replicas_trust_gateway
        limit = self.limiter.admit(tenant, parsed.model, parsed.input_tokens, parsed.max_tokens,
                                   now, parsed.num_sequences, check_max_input)  # fmt: skip
        if not limit.ok:
            reason = str(limit.reason)
            self.metrics.rejections.labels(tenant.name, reason).inc()
            raise GatewayError(
                limit.status_code,
                limit.message,
                _REFUSAL_TYPES.get(limit.status_code, "invalid_request_error"),
                reason,
                limit.retry_after_s if limit.status_code == 429 else None,
                limit.param,
            )
        admitted = self.admission.try_admit(tenant.priority, parsed.num_sequences)
        if not admitted.ok:
            self.limiter.charge(tenant.name, -limit.num_reserved_tokens, now)
            self.limiter.release(tenant.name, parsed.num_sequences)
            self.metrics.rejections.labels(tenant.name, admitted.reason or "queue_full").inc()
            if admitted.status_code == 400:
                raise GatewayError(400, admitted.message, code=admitted.reason)
            raise unavailable(admitted.message, admitted.retry_after_s or 1.0)
        if limit.max_tokens is not None and parsed.max_tokens is None:
            parsed.set("max_tokens", limit.max_tokens)
            parsed.max_tokens = limit.max_tokens
        parsed.set("priority", int(tenant.priority))  # the tenant's class, not the client's
        return RequestHold(self.accounting, tenant, parsed.num_sequences, parsed.input_tokens,
                     limit.num_reserved_tokens, time.perf_counter(), request_id,
                     parsed.model or "default", span)  # fmt: skip

    def _requested_tier(self, request: Request) -> str | None:
        """The tier the client named (`x-modelship-tier`), checked; None: not named."""
        name = request.headers.get(TIER_HEADER)
        if name is not None and name != PRIMARY and name not in self.tier_routers:
            served = ", ".join([PRIMARY, *self.tier_routers])
            raise GatewayError(400, f"{TIER_HEADER}: no tier is named so; served: {served}",
                               param=TIER_HEADER, code="unknown_tier")  # fmt: skip
        return name

    def pick_tier(self, parsed: ParsedRequest, tenant: Tenant) -> TierDecision:
        """Which tier serves the request (`tiers.choose_tier`), counted by tier and reason."""
        config = self.config
        if not config.tiers:
            self.metrics.tier_decisions.labels(PRIMARY, "default").inc()
            return TierDecision(PRIMARY, "default")
        loads = {PRIMARY: self._tier_load(PRIMARY)}
        for name in self.tier_routers:
            loads[name] = self._tier_load(name)
        need = TierNeed(tenant.priority, parsed.max_tokens, parsed.input_tokens,
                        parsed.requested_tier)  # fmt: skip
        decision = choose_tier(config.tiers, config.tier_rules, config.brownout, need,
                               tenant.config, loads)  # fmt: skip
        self.metrics.tier_decisions.labels(decision.tier, decision.reason).inc()
        return decision

    def _tier_load(self, tier: str) -> TierLoad:
        """A tier's routable replicas and the requests the gateway has there; the primary's
        counted on stable (a canary's share is small and judged on its own)."""
        endpoints = self.pool.endpoints(Track.STABLE, tier)
        routable = sum(1 for endpoint in endpoints if endpoint.is_routable)
        return TierLoad(routable, sum(endpoint.in_flight for endpoint in endpoints))

    def pick_track(self, parsed: ParsedRequest, tenant: Tenant, request_id: str) -> Track:
        """The tenant's session (or user, or conversation) stays on one side of the split.
        The key is hashed with the gateway's secret: a client choosing its session id
        cannot aim at (or away from) the canary.

        A request the split gives a canary whose every replica has its breaker open goes
        to stable, and counts as a canary failure for the judge: the canary failed enough
        requests in a row to be shut out, and without these the judge, starved of canary
        results, would never reach its `min_requests` and never roll it back."""
        if self.canary_weight <= 0:
            return Track.STABLE
        key = f"{tenant.name}\n{parsed.sticky_key or request_id}"
        if not in_canary(key, self.canary_weight, self.split_secret):
            return Track.STABLE
        if self.pool.has_routable(Track.CANARY):
            return Track.CANARY
        canary = [u for u in self.pool if u.track is Track.CANARY]
        if canary and all(u.breaker.state is BreakerState.OPEN for u in canary):
            self.judge.record(Track.CANARY, ok=False, ttft_s=None, tenant=tenant.name)
            self._judge_canary()
        return Track.STABLE

    def _candidates(
        self, track: Track, routing: RoutingRequest, tier: str = PRIMARY
    ) -> Iterator[Upstream]:
        """The router's choice, then its fallbacks. A canary request falls back to stable's
        replicas (asked only when the canary's have failed): its client gets an answer,
        and the judge has already counted the canary's failure. A cheaper tier's request
        falls back to the primary's stable replicas the same way."""
        if tier != PRIMARY:
            groups = [(Track.STABLE, tier), (Track.STABLE, PRIMARY)]
        elif track is Track.CANARY:
            groups = [(Track.CANARY, PRIMARY), (Track.STABLE, PRIMARY)]
        else:
            groups = [(track, PRIMARY)]
        for i, (candidate_track, candidate_tier) in enumerate(groups):
            router = (
                self.routers[candidate_track]
                if candidate_tier == PRIMARY
                else self.tier_routers[candidate_tier]
            )
            try:
                decision = router.choose(
                    routing, self.pool.endpoints(candidate_track, candidate_tier)
                )
            except NoEndpointError:
                continue
            if i == 0:
                self.metrics.routing_decisions.labels(self.policy, str(decision.reason)).inc()
            for endpoint in [decision.endpoint, *decision.fallbacks]:
                if (upstream := self.pool.get(endpoint.endpoint_id)) is not None:
                    yield upstream

    async def _forward(
        self, path: str, parsed: ParsedRequest, tenant: Tenant, hold: RequestHold, request_id: str
    ) -> Response:
        resilience = self.config.resilience
        tier = self.pick_tier(parsed, tenant).tier
        track = self.pick_track(parsed, tenant, request_id) if tier == PRIMARY else Track.STABLE
        estimate = self.estimator.estimate(parsed.max_tokens)
        routing = parsed.routing_request(estimate, tenant.cache_salt)
        pass_usage_event = True
        if parsed.stream:
            pass_usage_event = ask_for_usage(parsed.body)
            parsed.set("stream_options", parsed.body["stream_options"])
        failover = (
            parsed.stream
            and resilience.max_failovers > 0
            and self.replicas_trust_gateway  # ours, with their key: they take the fields
            and can_fail_over(parsed.body, parsed.num_sequences)
        )
        pass_token_ids = parsed.body.get("return_token_ids") is True  # the client's own ask
        if failover:
            parsed.set("return_token_ids", True)  # what a resuming replica is sent
        # `priority` as each engine reads it; vLLM's `cache_salt` field (wins over a client's)
        bodies = UpstreamBodies(parsed, tenant.priority, tenant.cache_salt)
        headers = {
            **self.upstream_headers,
            REQUEST_ID_HEADER: request_id,
            CACHE_SALT_HEADER: tenant.cache_salt,  # equal prefixes are shared within it only
        }
        if tenant.config.max_input_tokens is not None:  # checked on the replica's own count
            headers[MAX_INPUT_TOKENS_HEADER] = str(tenant.config.max_input_tokens)
        deadline = asyncio.get_running_loop().time() + resilience.request_timeout_s
        attempt: Attempt | None = None
        num_attempts = num_candidates = 0
        try:
            async with asyncio.timeout_at(deadline):
                for upstream in self._candidates(track, routing, tier):
                    num_candidates += 1
                    if num_attempts >= self.retry_policy.max_attempts:
                        break
                    if not upstream.breaker.allow_request():
                        continue
                    if num_attempts:
                        await asyncio.sleep(self.retry_policy.backoff_s(num_attempts))
                    num_attempts += 1
                    attempt = await self._attempt(
                        upstream, path, bodies.of(upstream.engine), headers, parsed, hold, routing
                    )
                    if attempt.failure is None or not self.retry_policy.should_retry(
                        attempt.failure, num_attempts
                    ):
                        break
                    self.metrics.retries.labels(str(attempt.failure.kind)).inc()
        except TimeoutError:
            raise GatewayError(
                504, "The model did not answer in time.", "timeout", "timeout"
            ) from None
        if num_candidates == 0:
            raise unavailable("no replica is ready to serve; retry shortly")
        if attempt is None:
            raise unavailable("every replica's circuit breaker is open; retry shortly")
        raise_for_final(attempt)
        hold.upstream = attempt.upstream
        hold.tried.add(attempt.upstream.endpoint_id)
        if parsed.stream and attempt.status_code == 200:
            usage = StreamUsage(pass_usage_event)
            resume = None
            if failover:
                resume = functools.partial(
                    self._resume, path, parsed, headers, track, tier, routing, hold, request_id
                )
            return self._stream(attempt, hold, request_id, routing.num_tokens, deadline, usage,
                                resume, pass_token_ids)  # fmt: skip
        attempt.upstream.endpoint.remove_request(routing.num_tokens)
        usage = Usage.from_payload(attempt.payload) if attempt.status_code == 200 else None
        if usage is not None:
            self.estimator.observe(usage.completion_tokens // parsed.num_sequences)
        hold.end(attempt.status_code, attempt.ttft_s, usage or Usage(parsed.input_tokens, 0))
        headers = _response_headers(attempt, request_id, self.auth.says_release(tenant))
        return Response(attempt.body, status_code=attempt.status_code, headers=headers)

    async def _attempt(
        self,
        upstream: Upstream,
        path: str,
        content: bytes,
        headers: dict[str, str],
        parsed: ParsedRequest,
        hold: RequestHold,
        routing: RoutingRequest,
    ) -> Attempt:
        resilience = self.config.resilience
        # A non-streaming answer comes only when generation ends: it may take as long as
        # the request may.
        read_timeout_s = (
            resilience.first_byte_timeout_s if parsed.stream else resilience.request_timeout_s
        )
        num_tokens = routing.num_tokens
        hold.num_attempts += 1
        span = self.tracing.start_span("upstream attempt", hold.span, {
            "attempt": hold.num_attempts, "endpoint": upstream.endpoint_id,
            "release": upstream.release, "variant": upstream.variant,
        }, kind=SpanKind.CLIENT)  # fmt: skip
        if self.tracing.is_enabled:  # the replica continues the trace under this attempt
            headers = {**headers}
            inject(span, headers)
        upstream.endpoint.add_request(num_tokens)
        # Charged if the request is abandoned while the replica generates (client gone,
        # deadline): the gateway never learns how much it produced.
        hold.num_output_if_abandoned = routing.num_sequences * (
            routing.estimated_output_tokens or 0
        )
        send = send_attempt(
            self.transport,
            upstream,
            path,
            content,
            headers,
            parsed.stream,
            read_timeout_s,
            resilience.connect_timeout_s,
            hold.started_at,
        )
        try:
            attempt = await _unless_unresponsive(send, upstream)
        except BaseException:  # cancelled (client gone, deadline): nobody's fault
            upstream.endpoint.remove_request(num_tokens)
            end_span(span, {"status": 499})
            raise
        failure = attempt.failure
        if failure is None and parsed.stream and attempt.status_code == 200:
            hold.attempt_span = span  # ended with the stream
        else:
            kind = str(failure.kind) if failure is not None else None
            end_span(span, {"status": attempt.status_code, "failure": kind}, error=bool(failure))
        if attempt.failure is not None:
            hold.num_output_if_abandoned = 0
            upstream.endpoint.remove_request(num_tokens)
            self._record(upstream, hold, ok=False, kind=str(attempt.failure.kind))
        elif attempt.status_code >= 400:
            # The request's own fault (bad input, over a limit): the replica is fine, but
            # its quick refusal says nothing about how fast it serves.
            self._record(upstream, hold, ok=True, judge=False)
        elif not parsed.stream:
            # Judged on errors alone: the whole answer's time is mostly the output length
            # the client asked for, not the release's speed.
            self._record(upstream, hold, ok=True)
        # A stream in progress is recorded when it ends (it may still break).
        return attempt

    def _stream(
        self,
        attempt: Attempt,
        hold: RequestHold,
        request_id: str,
        num_tokens: int,
        deadline: float,
        usage: StreamUsage,
        resume: Resume | None = None,
        pass_token_ids: bool = True,
    ) -> StreamingResponse:
        first = attempt  # its first byte and first token came from this replica

        def on_end(how: StreamEnd, attempt: Attempt) -> None:
            upstream = attempt.upstream  # the last replica that served the stream
            upstream.endpoint.remove_request(num_tokens)
            if how is StreamEnd.COMPLETE:
                ttft_s = None  # judged only where one replica served the whole stream
                if usage.first_token_at is not None and attempt is first:
                    prompt_tokens = usage.usage.prompt_tokens if usage.usage else hold.input_tokens
                    first_token_s = usage.first_token_at - hold.started_at
                    ttft_s = judged_ttft(first_token_s, prompt_tokens)
                self._record(upstream, hold, ok=True, ttft_s=ttft_s)
            elif how is StreamEnd.REPLICA_FAILED:
                self._record(upstream, hold, ok=False, kind="read")
            # A client hanging up or a request past its own deadline says nothing about
            # the replica.
            used = usage.usage
            if used is None:  # cut short: charged for the events that came through
                used = Usage(hold.input_tokens, usage.num_events)
            elif how is StreamEnd.COMPLETE:
                self.estimator.observe(used.completion_tokens // hold.num_sequences)
            if usage.first_token_at is not None:
                served_first = first.upstream  # after a failover, not the last replica
                self.metrics.first_token.labels(served_first.release, served_first.variant).observe(
                    usage.first_token_at - hold.started_at
                )
            hold.end(how.status_code, first.ttft_s, used)

        headers = _response_headers(attempt, request_id, self.auth.says_release(hold.tenant))
        events = pump(attempt, deadline, usage, on_end, resume, pass_token_ids)
        return StreamingResponse(events, headers=headers)

    async def _resume(
        self,
        path: str,
        parsed: ParsedRequest,
        headers: dict[str, str],
        track: Track,
        tier: str,
        routing: RoutingRequest,
        hold: RequestHold,
        request_id: str,
        failed: Attempt,
        progress: StreamProgress,
    ) -> Attempt | None:
        """A stream's replica failed mid-stream: resume it on another replica, trying at
        most `max_failovers` of them; None when none could (the stream then ends with an
        error event). The failed replica's request is ended and counted here."""
        failed.upstream.endpoint.remove_request(routing.num_tokens)
        self._record(failed.upstream, hold, ok=False, kind="read")
        if hold.num_failovers >= self.config.resilience.max_failovers:
            self.metrics.failovers.labels(str(FailoverOutcome.EXHAUSTED)).inc()
            return None
        content = parsed.encode(resume_token_ids=progress.token_ids)
        for upstream in self._candidates(track, routing, tier):
            if hold.num_failovers >= self.config.resilience.max_failovers:
                break
            if (
                upstream.endpoint_id in hold.tried
                or not upstream.engine.can_resume  # vLLM ignores `resume_token_ids`
                or not upstream.breaker.allow_request()
            ):
                continue
            hold.num_failovers += 1
            hold.tried.add(upstream.endpoint_id)
            attempt = await self._attempt(upstream, path, content, headers, parsed, hold, routing)
            if attempt.failure is None and attempt.status_code == 200:
                logger.warning(
                    "request %s: replica %s failed mid-stream after %d tokens; resumed on %s",
                    request_id, failed.upstream.endpoint_id, len(progress.token_ids),
                    upstream.endpoint_id,
                )  # fmt: skip
                self.metrics.failovers.labels(str(FailoverOutcome.RESUMED)).inc()
                hold.upstream = upstream
                return attempt
            if attempt.failure is None:  # refused (4xx): no replica will take it
                upstream.endpoint.remove_request(routing.num_tokens)
                logger.warning("request %s: resume refused with %d: %s", request_id,
                               attempt.status_code, attempt.body[:200])  # fmt: skip
                break
        logger.warning(
            "request %s: replica %s failed mid-stream after %d tokens; no replica resumed it",
            request_id, failed.upstream.endpoint_id, len(progress.token_ids),
        )  # fmt: skip
        self.metrics.failovers.labels(str(FailoverOutcome.EXHAUSTED)).inc()
        return None

    def _record(
        self,
        upstream: Upstream,
        hold: RequestHold,
        ok: bool,
        ttft_s: float | None = None,
        kind: str | None = None,
        judge: bool = True,
    ) -> None:
        """One replica result: `ok=False` only for the replica's own faults; `ttft_s` a
        stream's `judged_ttft` (None: the canary judge counts only whether it failed)."""
        if self.pool.record_result(upstream, ok):
            logger.warning("circuit breaker opened for %s", upstream.endpoint_id)
            self.metrics.breaker_opened.labels(upstream.endpoint_id, upstream.release).inc()
        if not ok:
            self.metrics.upstream_failures.labels(upstream.release, upstream.variant, kind).inc()
        if not judge:
            return
        self.judge.record(upstream.track, ok, ttft_s, hold.tenant.name)
        if upstream.track is Track.CANARY:
            self._judge_canary()

    def _judge_canary(self) -> None:
        if not self.config.canary.auto_rollback or self.canary_weight <= 0:
            return
        verdict = self.judge.verdict()
        if not verdict.rollback:
            return
        self.canary_weight = 0  # from this request on, nothing goes to the canary
        logger.warning("canary rolled back: %s", verdict.reason)
        canary_release = next((u.release for u in self.pool if u.track is Track.CANARY), "none")
        self.metrics.canary_rollbacks.labels(canary_release).inc()
        if self.on_canary_rollback is not None:
            self.on_canary_rollback(verdict)

    def set_canary_weight(self, weight: int) -> None:
        if weight != self.canary_weight:
            self.judge.reset()  # each canary is judged on its own traffic
            self.canary_weight = weight


async def _unless_unresponsive(send: Coroutine[Any, Any, Attempt], upstream: Upstream) -> Attempt:
    """Await `send` (an attempt at `upstream`), or abandon it once the health checks find
    the replica unresponsive (a hung process: its answer would only come at the timeout,
    which for a non-streaming request is the whole request's). Abandoned before any byte
    of an answer, the attempt can be retried elsewhere."""
    sending = asyncio.ensure_future(send)
    abandoned = False

    def abandon() -> None:
        nonlocal abandoned
        abandoned = True
        sending.cancel()

    unregister = upstream.on_unresponsive(abandon)
    try:
        # Cancelling the caller cancels `sending` too.
        return await sending
    except asyncio.CancelledError:
        if abandoned and not _is_cancelling():
            return Attempt(upstream, failure=Failure(FailureKind.UNRESPONSIVE))
        raise
    finally:
        unregister()


def _is_cancelling() -> bool:
    """Whether the running task itself is being cancelled (not just what it awaits)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected (its body was read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _response_headers(attempt: Attempt, request_id: str, with_release: bool) -> dict[str, str]:
    """The replica's content headers, plus which variant and tier answered, and with
    `with_release` which release (`GatewayAuth.says_release`)."""
    headers = {
        **attempt.passed_headers(),
        REQUEST_ID_HEADER: request_id,
        "x-modelship-variant": attempt.upstream.variant,
        TIER_HEADER: attempt.upstream.tier,
    }
    if with_release:
        headers["x-modelship-release"] = attempt.upstream.release
    return headers
