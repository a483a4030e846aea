"""OpenTelemetry traces of the request path, shared by the gateway and the replicas.

One `Tracing` per process. Off (`exporter: none`, the default) it makes no spans at all:
`start_span` hands back the SDK's invalid span, whose methods do nothing, and no
`traceparent` is sent. On, spans go through a batch processor (exporting never blocks a
request) to one exporter: `console` (stdout), `file` (one JSON object per span and line,
appended, so the gateway and its replicas can share a file) or `otlp` (OTLP/HTTP; the
SDK's `OTEL_EXPORTER_OTLP_*` variables apply, as do `OTEL_BSP_*` for the batching).

The trace crosses processes in the W3C `traceparent` header: the gateway injects its
attempt span's, the replica continues from it (`TracingMiddleware`). A client's own
`traceparent` never parents the gateway's spans: the gateway starts a new trace (sampled at
its `sample_ratio`, not at the client's word, which would write spans naming the tenant
under a trace id the client chose) and keeps the client's context as a span link.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, Literal

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import INVALID_SPAN, Link, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import BaseModel, ConfigDict, Field, model_validator

from modelship.flags import flag_args

Exporter = Literal["none", "console", "file", "otlp"]
EXPORTERS: tuple[str, ...] = ("none", "console", "file", "otlp")
_PROPAGATOR = TraceContextTextMapPropagator()
TRACE_FLAG_PREFIX = "trace_"  # `modelship serve --trace-exporter` etc.


class TracingConfig(BaseModel):
    """pipeline.yaml's `tracing:` section (and `modelship serve --trace-*`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exporter: Exporter = Field(
        default="none", description="Where spans go: none (tracing off), console, file, otlp."
    )
    endpoint: str | None = Field(  # otlp (else $OTEL_EXPORTER_OTLP_ENDPOINT)
        default=None,
        description="OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (else "
        "$OTEL_EXPORTER_OTLP_ENDPOINT).",
    )
    sample_ratio: float = Field(  # of new traces (the gateway's)
        default=1.0,
        ge=0,
        le=1,
        description="Share of new traces sampled (0..1); a traceparent decides for requests "
        "that bring one.",
    )
    file: Path | None = Field(  # file: JSON lines, appended
        default=None, description="JSON lines of spans, appended (--trace-exporter file)."
    )

    @model_validator(mode="after")
    def _exporter_has_its_target(self) -> TracingConfig:
        if self.exporter == "file" and self.file is None:
            raise ValueError("exporter file needs `file` (a path for the JSON lines)")
        return self

    @property
    def is_enabled(self) -> bool:
        return self.exporter != "none"

    def cli_args(self) -> list[str]:
        """The same setting as `modelship serve --trace-*` flags (none while off), a file
        as an absolute path (the fleet's replicas)."""
        if not self.is_enabled:
            return []
        return flag_args(self.resolved(), prefix=TRACE_FLAG_PREFIX)

    def resolved(self) -> TracingConfig:
        """This config with its file as an absolute path."""
        if self.file is None:
            return self
        return self.model_copy(update={"file": Path(self.file).resolve()})


class JsonLinesSpanExporter(SpanExporter):
    """Spans as JSON lines appended to `path`. Each batch is one `write` on an O_APPEND
    descriptor, so processes sharing the file never interleave within a line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(span)) + "\n" for span in spans).encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as the file exporter writes it (ids in hex, as in `traceparent`)."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "service": span.resource.attributes.get("service.name"),
        "attributes": dict(span.attributes or {}),
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
            for link in span.links
        ],
    }


def create_exporter(config: TracingConfig) -> SpanExporter:
    if config.exporter == "console":
        return ConsoleSpanExporter()
    if config.exporter == "file":
        assert config.file is not None
        return JsonLinesSpanExporter(config.file)
    if config.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = config.endpoint
        if endpoint and not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return OTLPSpanExporter(endpoint=endpoint)
    raise ValueError(f"unknown trace exporter {config.exporter!r}; supported: {EXPORTERS}")


class Tracing:
    """The tracer of one process (`service_name`: modelship-gateway, modelship-replica), or
    none when `config` turns tracing off. `exporter` replaces the configured one (tests
    pass the SDK's `InMemorySpanExporter`)."""

    def __init__(
        self,
        config: TracingConfig | None = None,
        service_name: str = "modelship",
        exporter: SpanExporter | None = None,
    ) -> None:
        self.config = config or TracingConfig()
        self.is_enabled = self.config.is_enabled or exporter is not None
        self.provider: TracerProvider | None = None
        self.tracer: trace.Tracer = trace.NoOpTracer()
        if not self.is_enabled:
            return
        # Parent-based: a replica follows the gateway's decision in `traceparent`; the
        # ratio applies to the traces the gateway starts.
        sampler = ParentBased(TraceIdRatioBased(self.config.sample_ratio))
        resource = Resource.create({"service.name": service_name})
        self.provider = TracerProvider(resource=resource, sampler=sampler)
        processor = BatchSpanProcessor(exporter or create_exporter(self.config))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("modelship")

    def start_span(
        self,
        name: str,
        parent: Span | otel_context.Context | None = None,
        attributes: Mapping[str, Any] | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        start_time_ns: int | None = None,
        links: Sequence[Link] = (),
    ) -> Span:
        """A started span (ended by the caller), child of `parent` (a span, or a context
        taken from a `traceparent`); a new trace without one. Off: the invalid span."""
        if not self.is_enabled:
            return INVALID_SPAN
        if isinstance(parent, Span):
            parent = trace.set_span_in_context(parent)
        return self.tracer.start_span(
            name, context=parent, kind=kind, attributes=attributes, start_time=start_time_ns,
            links=links,
        )  # fmt: skip

    def force_flush(self) -> None:
        if self.provider is not None:
            self.provider.force_flush()

    def shutdown(self) -> None:
        """Export what is pending; call once at the process's end."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None


def inject(span: Span, headers: MutableMapping[str, str]) -> None:
    """Add `span`'s `traceparent` to outgoing `headers` (nothing for the invalid span)."""
    if span.get_span_context().is_valid:
        _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))


def extract(headers: Mapping[str, str]) -> otel_context.Context:
    """The remote parent in incoming `headers` (an empty context without a valid one)."""
    return _PROPAGATOR.extract(headers)


def client_links(headers: Mapping[str, str]) -> list[Link]:
    """The client's `traceparent` in incoming `headers` as a link (none without a valid
    one): what the gateway keeps of a trace it does not continue."""
    remote = trace.get_current_span(extract(headers)).get_span_context()
    return [Link(remote)] if remote.is_valid else []


def end_span(span: Span, attributes: Mapping[str, Any], error: bool = False) -> None:
    """Set `attributes` (None values left out) and end `span`."""
    if not span.is_recording():
        return
    span.set_attributes({key: value for key, value in attributes.items() if value is not None})
    if error:
        span.set_status(trace.StatusCode.ERROR)
    span.end()
