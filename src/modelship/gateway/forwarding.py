"""Forwarding an admitted request to replicas: candidates, retries, attempts, streams and
mid-stream resume.

The `Forwarder` tries the group's replicas in the router's order (then its fallbacks, then
the groups after it in `groups.fallback_order`), skipping open breakers, with
backoff between attempts, within the request's deadline. Each replica's result goes to its
breaker and, except a client's own 4xx, to the canary judge (`judge_result`). A stream
whose replica fails mid-way is resumed on another from the tokens already sent, when the
replicas trust the gateway (`Forwarder.replicas_trust_gateway`). `unless_client_gone`
cancels the whole forward when its client hangs up before the answer starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from modelship.gateway.accounting import RequestHold
from modelship.gateway.canary import Track, judged_ttft
from modelship.gateway.config import GatewayConfig
from modelship.gateway.endpoint import NoEndpointError, OutputLengthEstimator, RoutingRequest
from modelship.gateway.engines import UpstreamBodies
from modelship.gateway.failover import FailoverOutcome, StreamProgress, can_fail_over
from modelship.gateway.groups import Group, fallback_order
from modelship.gateway.metrics import GatewayMetrics
from modelship.gateway.models import MODEL_HEADER, ModelCatalog
from modelship.gateway.pool import EndpointPool, Upstream
from modelship.gateway.proxy import (
    Attempt,
    Resume,
    StreamEnd,
    pump,
    raise_for_final,
    send_attempt,
)
from modelship.gateway.request import GatewayError, ParsedRequest, unavailable
from modelship.gateway.resilience import Failure, FailureKind, RetryPolicy
from modelship.gateway.routing import Router, create_router
from modelship.gateway.tenants import Tenant
from modelship.gateway.tiers import TIER_HEADER
from modelship.gateway.usage import StreamUsage, Usage, ask_for_usage
from modelship.replica_headers import CACHE_SALT_HEADER, MAX_INPUT_TOKENS_HEADER
from modelship.request_id import REQUEST_ID_HEADER
from modelship.tracing import SpanKind, Tracing, end_span, inject

logger = logging.getLogger(__name__)


class Forwarder:
    """Sends admitted requests to the pool's replicas; one per gateway process.

    `judge_result(track, ok, ttft_s, tenant)` hears each replica result the canary judge
    counts; `says_release(tenant)` whether a response names its release."""

    def __init__(
        self,
        config: GatewayConfig,
        pool: EndpointPool,
        metrics: GatewayMetrics,
        tracing: Tracing,
        upstream_headers: dict[str, str],
        has_replica_key: bool,
        judge_result: Callable[[Track, bool, float | None, str], None],
        says_release: Callable[[Tenant], bool],
        catalog: ModelCatalog | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.tracing = tracing
        self.judge_result = judge_result
        self.says_release = says_release
        self.catalog = catalog or ModelCatalog()
        resilience = config.resilience
        self.retry_policy = RetryPolicy(
            max_attempts=resilience.max_attempts,
            base_backoff_s=resilience.base_backoff_s,
            max_backoff_s=resilience.max_backoff_s,
            rng=random.Random(),
        )
        self.policy = config.routing.policy
        self.routers: dict[Group, Router] = {}  # one per group, made when first routed to
        self.estimator = OutputLengthEstimator(float(config.initial_output_tokens))
        self.upstream_headers = upstream_headers  # the service's: type, the replicas' key
        self.has_replica_key = has_replica_key
        # The gateway's connection pool (set when it starts); attempts are sent on it.
        self.transport: httpx.AsyncHTTPTransport | None = None

    @property
    def replicas_trust_gateway(self) -> bool:
        """Our replicas take the gateway's settings (cache namespace, input cap, failover's
        fields) only with their key (server/gateway_hints.py): without one, or behind vLLM
        (which reads none of them), the gateway checks `max_input_tokens` on its estimate
        and streams never fail over."""
        return self.has_replica_key and self.pool.can_resume()

    async def forward(
        self,
        path: str,
        parsed: ParsedRequest,
        tenant: Tenant,
        hold: RequestHold,
        request_id: str,
        group: Group,
        home: Group | None = None,
    ) -> Response:
        """The response to an admitted request, from the first of the group's replicas
        (then its fallbacks, then `home`'s: `groups.fallback_order`) to answer; the hold
        ends here unless a stream is returned (it ends with the stream). A `GatewayError`
        when none did."""
        order = fallback_order(group, home)
        resilience = self.config.resilience
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
                for upstream in self.candidates(order, routing):
                    num_candidates += 1
                    if num_attempts >= self.retry_policy.max_attempts:
                        break
                    if not upstream.breaker.allow_request():
                        continue
                    if num_attempts:
                        await asyncio.sleep(self.retry_policy.backoff_s(num_attempts))
                    num_attempts += 1
                    body = bodies.of(upstream.engine, self._model_field(upstream, parsed))
                    attempt = await self._attempt(
                        upstream, path, body, headers, parsed, hold, routing
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
                    self._resume, path, parsed, headers, order, routing, hold, request_id
                )
            return self._stream(attempt, hold, request_id, routing.num_tokens, deadline, usage,
                                resume, parsed)  # fmt: skip
        attempt.upstream.endpoint.remove_request(routing.num_tokens)
        usage = Usage.from_payload(attempt.payload) if attempt.status_code == 200 else None
        if usage is not None:
            self.estimator.observe(usage.completion_tokens // parsed.num_sequences)
        hold.end(attempt.status_code, attempt.ttft_s, usage or Usage(parsed.input_tokens, 0))
        headers = self._response_headers(attempt, request_id, tenant, parsed)
        return Response(attempt.body, status_code=attempt.status_code, headers=headers)

    def candidates(self, order: tuple[Group, ...], routing: RoutingRequest) -> Iterator[Upstream]:
        """For each group of `order` (`fallback_order`): its router's choice, then its
        fallbacks. Only the first group's routing decision is counted."""
        for i, candidate in enumerate(order):
            router = self.routers.get(candidate)
            if router is None:
                router = create_router(self.policy, **self.config.routing.options)
                self.routers[candidate] = router
            try:
                decision = router.choose(routing, self.pool.endpoints(candidate))
            except NoEndpointError:
                continue
            if i == 0:
                self.metrics.routing_decisions.labels(self.policy, str(decision.reason)).inc()
            for endpoint in [decision.endpoint, *decision.fallbacks]:
                if (upstream := self.pool.get(endpoint.endpoint_id)) is not None:
                    yield upstream

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
        parsed: ParsedRequest | None = None,
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

        headers = self._response_headers(attempt, request_id, hold.tenant, parsed)
        return StreamingResponse(pump(attempt, deadline, usage, on_end, resume), headers=headers)

    async def _resume(
        self,
        path: str,
        parsed: ParsedRequest,
        headers: dict[str, str],
        order: tuple[Group, ...],
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
        model = failed.upstream.group.model
        extra = {"model": name} if (name := self._model_field(failed.upstream, parsed)) else {}
        content = parsed.encode(resume_token_ids=progress.token_ids, **extra)
        for upstream in self.candidates(order, routing):
            if hold.num_failovers >= self.config.resilience.max_failovers:
                break
            if (
                upstream.group.model != model  # another model continues no model's tokens
                or upstream.endpoint_id in hold.tried
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
        self.judge_result(upstream.track, ok, ttft_s, hold.tenant.name)

    def _model_field(self, upstream: Upstream, parsed: ParsedRequest) -> str | None:
        """The `model` the replica is asked for: its model's name where a model tier sent
        the request there, else None (the client's own)."""
        if upstream.group.model == parsed.served_model:
            return None
        return self.catalog.name_of(upstream.group.model, parsed.model)

    def _response_headers(
        self, attempt: Attempt, request_id: str, tenant: Tenant, parsed: ParsedRequest | None
    ) -> dict[str, str]:
        """The replica's content headers, plus which model, variant and tier answered, and
        for a tenant that may know it (`GatewayAuth.says_release`) which release."""
        upstream = attempt.upstream
        requested = parsed.model if parsed is not None else ""
        tier = upstream.tier
        if parsed is not None and parsed.model_tier and self._model_field(upstream, parsed):
            tier = parsed.model_tier  # another model answered as the tier
        headers = {
            **attempt.passed_headers(),
            REQUEST_ID_HEADER: request_id,
            MODEL_HEADER: self.catalog.name_of(upstream.group.model, requested),
            "x-modelship-variant": upstream.variant,
            TIER_HEADER: tier,
        }
        if self.says_release(tenant):
            headers["x-modelship-release"] = upstream.release
        return headers


async def unless_client_gone(
    request: Request, forward: Coroutine[Any, Any, Response], hold: RequestHold
) -> Response:
    """Await `forward` (an admitted request's), cancelled if the client hangs up before the
    response starts (once a stream is under way, Starlette cancels it the same way): the
    hold then ends with 499."""
    forwarding = asyncio.ensure_future(forward)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({forwarding, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not forwarding.done():
            forwarding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await forwarding
            hold.end(499, None)
    if forwarding.cancelled():
        return Response(status_code=499)  # nobody reads it
    return forwarding.result()


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected (its body was read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
