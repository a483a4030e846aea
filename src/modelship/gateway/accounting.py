"""What a request holds while the gateway serves it, and what its end records.

An admitted request holds a tenant concurrency slot, an admission slot and a token
reservation until its response ends, however it ends (`RequestHold.end`, which runs once):
the slots go back, the unused part of the reservation is refunded (or an underestimate
charged), and the request's tokens, cost, usage line, latency, spans and access-log line
are recorded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from modelship.gateway.admission import AdmissionQueue
from modelship.gateway.cost import Price, UsageLedger, UsageRecord, now_utc
from modelship.gateway.metrics import GatewayMetrics
from modelship.gateway.pool import Upstream
from modelship.gateway.tenant_state import TenantState
from modelship.gateway.tenants import LimitDecision, Tenant
from modelship.gateway.usage import Usage
from modelship.tracing import Span, end_span

access_logger = logging.getLogger("modelship.access")  # one line per request, if enabled


@dataclass(eq=False)
class Accounting:
    """Where requests' ends are recorded; one per gateway process."""

    tenant_state: TenantState
    admission: AdmissionQueue
    metrics: GatewayMetrics
    # variant -> price per 1k tokens (`modelship up` adds those derived from select's
    # measurements)
    prices: dict[str, Price] = field(default_factory=dict)
    ledger: UsageLedger | None = None  # the usage file on storage `modelship usage` reads
    access_log: bool = False  # one JSON line per request (`log_format: json`)


@dataclass(eq=False)
class RequestHold:
    """The slots an admitted request holds; `end` frees them once and records metrics."""

    accounting: Accounting
    tenant: Tenant
    num_sequences: int
    input_tokens: int  # as estimated at admission
    limit: LimitDecision  # the tenant's admission: its reservation, its hold in the store
    started_at: float
    request_id: str = ""
    model: str = "default"
    span: Span | None = None  # the gateway request span; None or invalid: not traced
    attempt_span: Span | None = None  # a streaming attempt's, open until the stream ends
    num_attempts: int = 0
    upstream: Upstream | None = None
    num_output_if_abandoned: int = 0  # while an attempt is generating
    ended: bool = False
    num_failovers: int = 0  # replicas tried to resume the stream
    tried: set[str] = field(default_factory=set)  # endpoints that served or resumed it

    def end(self, status_code: int, ttft_s: float | None, usage: Usage | None = None) -> None:
        """`usage`: as the replica counted it; None when the gateway never learned it (the
        estimated output is charged if the request was abandoned mid-generation)."""
        if self.ended:
            return
        self.ended = True
        abandoned = usage is None and self.num_output_if_abandoned > 0
        # Refused (an error status, no usage counted, nothing generated): the quota is
        # charged the estimate as before, but no tokens are recorded as used or billed. A
        # client's hang-up (499) is no refusal: a replica may have read its prompt.
        refused = usage is None and not abandoned and status_code >= 400 and status_code != 499
        if usage is None:
            usage = Usage(self.input_tokens, self.num_output_if_abandoned)
        num_used = usage.prompt_tokens + usage.completion_tokens
        reserved = self.limit.num_reserved_tokens
        if abandoned:  # mid-generation: it may have used all the reservation allowed
            num_used = max(num_used, reserved)
        accounting, name = self.accounting, self.tenant.name
        # The reservation covered the input's estimate and the output's bound: refund what
        # went unused (or charge an underestimated input, or an unbounded output).
        accounting.tenant_state.settle(self.tenant, self.limit, num_used - reserved,
                                       self.num_sequences)  # fmt: skip
        accounting.admission.release(self.tenant.priority, self.num_sequences)
        metrics = accounting.metrics
        release = self.upstream.release if self.upstream else "none"
        variant = self.upstream.variant if self.upstream else "none"
        # The model as a label only if a replica answered it (a replica refuses a name it
        # does not serve): the client writes it, and any string, lone surrogates included,
        # would be a new series, or a /metrics page that cannot be encoded.
        known = self.upstream is not None and status_code < 400
        model = self.model if known else "unknown"
        if refused:
            usage = Usage(0, 0)
        metrics.tokens.labels(name, model, variant, "input").inc(usage.prompt_tokens)
        metrics.tokens.labels(name, model, variant, "output").inc(usage.completion_tokens)
        price = accounting.prices.get(variant)
        cost = None if price is None else price.of(usage.prompt_tokens, usage.completion_tokens)
        if cost is not None:
            metrics.cost.labels(name, model, variant).inc(cost)
        if accounting.ledger is not None:
            accounting.ledger.append(
                UsageRecord(now_utc(), name, model, release, variant, status_code,
                            usage.prompt_tokens, usage.completion_tokens, cost)
            )  # fmt: skip
        metrics.requests.labels(name, str(status_code), release, variant).inc()
        metrics.latency.labels(release, variant).observe(time.perf_counter() - self.started_at)
        if ttft_s is not None and status_code < 500:
            metrics.ttft.labels(release, variant).observe(ttft_s)
        self._trace(status_code, release, variant, usage)

    def _trace(self, status_code: int, release: str, variant: str, usage: Usage) -> None:
        """End the request's spans; log its access line (`log_format: json`)."""
        traced = self.span is not None and self.span.is_recording()
        if not (traced or self.accounting.access_log):
            return  # tracing off (the default): nothing to do per request
        if self.attempt_span is not None:
            end_span(self.attempt_span, {"status": status_code}, error=status_code >= 500)
        fields = {
            "request_id": self.request_id, "tenant": self.tenant.name, "model": self.model,
            "release": release, "variant": variant, "status": status_code,
            "priority": self.tenant.priority.name.lower(), "attempts": self.num_attempts,
        }  # fmt: skip
        if self.span is not None:
            end_span(self.span, fields, error=status_code >= 500)
        if self.accounting.access_log:
            ctx = self.span.get_span_context() if self.span is not None else None
            if ctx is not None and ctx.is_valid:
                fields |= {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}
            latency_ms = round((time.perf_counter() - self.started_at) * 1e3, 3)
            fields |= {"latency_ms": latency_ms, "prompt_tokens": usage.prompt_tokens,
                       "completion_tokens": usage.completion_tokens}  # fmt: skip
            access_logger.info("%s %s %d", self.request_id, self.tenant.name, status_code,
                               extra=fields)  # fmt: skip
