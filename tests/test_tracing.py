"""Tracing and JSON logs in-process: spans through the SDK's in-memory exporter, the W3C
`traceparent` crossing between two tracers (two processes' worth), the engine's phase
spans from a request's deltas, the file exporter, and the JSON log formatter."""

from __future__ import annotations

import json
import logging
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN

from modelship.config import ConfigError, ModelshipConfig
from modelship.engine import SequenceDelta
from modelship.logs import JsonFormatter
from modelship.server.tracing import EngineSpans
from modelship.tracing import (
    JsonLinesSpanExporter,
    Tracing,
    TracingConfig,
    client_links,
    extract,
    inject,
)


def delta(tokens: list[int], finish: str | None = None, queue_time_s: float | None = None):
    return SequenceDelta("r1", 0, tokens, "x", None, finish, None, 7, 3, 2, queue_time_s)


def finished(tracing: Tracing, exporter: InMemorySpanExporter) -> dict[str, object]:
    tracing.force_flush()
    return {span.name: span for span in exporter.get_finished_spans()}


def test_off_by_default_makes_no_spans_and_sends_no_traceparent() -> None:
    tracing = Tracing()
    assert not tracing.is_enabled
    span = tracing.start_span("gateway request")
    assert span is INVALID_SPAN and not span.is_recording()
    headers: dict[str, str] = {}
    inject(span, headers)
    assert headers == {}
    assert ModelshipConfig().tracing.cli_args() == []


def test_a_trace_crosses_processes_in_traceparent_and_engine_phases_nest() -> None:
    gateway_out, replica_out = InMemorySpanExporter(), InMemorySpanExporter()
    gateway = Tracing(service_name="modelship-gateway", exporter=gateway_out)
    replica = Tracing(service_name="modelship-replica", exporter=replica_out)
    request = gateway.start_span("gateway request", attributes={"tenant": "alpha"})
    attempt = gateway.start_span("upstream attempt", request)
    headers: dict[str, str] = {}
    inject(attempt, headers)
    assert headers["traceparent"].startswith("00-")
    server = replica.start_span("replica request", extract(headers))
    # The engine's phases, from the deltas the request path sees.
    with trace.use_span(server, end_on_exit=True):
        spans = EngineSpans.start(replica)
        assert spans is not None
        time.sleep(0.002)
        spans.observe(delta([5]))
        time.sleep(0.002)
        spans.observe(delta([6, 7], finish="length", queue_time_s=0.001))
        spans.end()
    attempt.end()
    request.end()
    at_gateway, at_replica = finished(gateway, gateway_out), finished(replica, replica_out)
    trace_id = request.get_span_context().trace_id
    assert {s.context.trace_id for s in [*at_gateway.values(), *at_replica.values()]} == {trace_id}
    assert at_gateway["upstream attempt"].parent.span_id == request.get_span_context().span_id
    assert at_replica["replica request"].parent.span_id == attempt.get_span_context().span_id
    server_id = server.get_span_context().span_id
    queue, prefill, decode = (at_replica[f"engine.{n}"] for n in ("queue", "prefill", "decode"))
    assert {s.parent.span_id for s in (queue, prefill, decode)} == {server_id}
    # Back to back: queue -> prefill -> decode, inside the replica's request span.
    assert queue.start_time >= at_replica["replica request"].start_time
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    assert queue.end_time - queue.start_time == pytest.approx(1e6, abs=1e5)
    assert decode.end_time <= at_replica["replica request"].end_time
    assert prefill.attributes["prompt_tokens"] == 7 and prefill.attributes["cached_tokens"] == 2
    assert decode.attributes["output_tokens"] == 3
    assert decode.attributes["finish_reason"] == "length"


def test_an_unsampled_gateway_trace_is_not_sampled_at_the_replica() -> None:
    gateway_out, replica_out = InMemorySpanExporter(), InMemorySpanExporter()
    gateway = Tracing(TracingConfig(exporter="console", sample_ratio=0), exporter=gateway_out)
    replica = Tracing(TracingConfig(exporter="console", sample_ratio=1), exporter=replica_out)
    headers: dict[str, str] = {}
    inject(gateway.start_span("gateway request"), headers)
    assert int(headers["traceparent"][-2:], 16) & 1 == 0  # the sampled flag is off
    replica.start_span("replica request", extract(headers)).end()
    assert finished(replica, replica_out) == {}


def test_the_file_exporter_writes_one_json_object_per_span(tmp_path) -> None:
    path = tmp_path / "spans" / "spans.jsonl"
    tracing = Tracing(service_name="modelship-gateway", exporter=JsonLinesSpanExporter(path))
    parent = tracing.start_span("gateway request", attributes={"tenant": "alpha"})
    tracing.start_span("upstream attempt", parent).end()
    parent.end()
    tracing.shutdown()
    records = {r["name"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert records["upstream attempt"]["parent_span_id"] == records["gateway request"]["span_id"]
    assert records["gateway request"]["parent_span_id"] is None
    assert records["gateway request"]["attributes"] == {"tenant": "alpha"}
    assert records["gateway request"]["service"] == "modelship-gateway"
    assert len(records["gateway request"]["trace_id"]) == 32


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="tracing: exporter file needs `file`"):
        ModelshipConfig.from_dict({"tracing": {"exporter": "file"}})
    with pytest.raises(ConfigError, match=r"tracing\.exporter: Input should be"):
        ModelshipConfig.from_dict({"tracing": {"exporter": "jaeger"}})
    with pytest.raises(ConfigError, match=r"tracing\.sample_ratio"):
        ModelshipConfig.from_dict({"tracing": {"exporter": "otlp", "sample_ratio": 2}})
    with pytest.raises(ConfigError, match="log_format"):
        ModelshipConfig.from_dict({"log_format": "xml"})
    config = ModelshipConfig.from_dict({"tracing": {"exporter": "file", "file": "t.jsonl"}})
    args = config.tracing.cli_args()
    assert args[:2] == ["--trace-exporter", "file"] and args[-2] == "--trace-file"


def test_json_log_lines_carry_the_request_fields_and_the_current_trace() -> None:
    tracing = Tracing(exporter=InMemorySpanExporter())
    record = logging.makeLogRecord(
        {"name": "modelship.access", "levelname": "INFO", "msg": "done %d", "args": (200,)}
    )
    record.request_id, record.tenant, record.release, record.variant = "r1", "alpha", 3, "awq"
    span = tracing.start_span("gateway request")
    with trace.use_span(span, end_on_exit=True):
        line = JsonFormatter().format(record)
    entry = json.loads(line)
    assert "\n" not in line
    assert entry["message"] == "done 200" and entry["logger"] == "modelship.access"
    assert (entry["request_id"], entry["tenant"], entry["release"], entry["variant"]) == (
        "r1", "alpha", 3, "awq",
    )  # fmt: skip
    assert entry["trace_id"] == f"{span.get_span_context().trace_id:032x}"
    assert entry["span_id"] == f"{span.get_span_context().span_id:016x}"
    assert "args" not in entry and "msg" not in entry


def test_a_client_traceparent_is_a_link_and_decides_no_sampling() -> None:
    """The gateway's request span starts a trace of its own, sampled at its own ratio; the
    client's context is kept only as a link (its sampled flag decides nothing)."""
    client = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert client_links({}) == [] and client_links({"traceparent": "00-bad"}) == []
    (link,) = client_links({"traceparent": client})
    assert f"{link.context.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
    never = Tracing(TracingConfig(sample_ratio=0.0), exporter=InMemorySpanExporter())
    assert not never.start_span("gateway request", None, links=[link]).is_recording()
    exporter = InMemorySpanExporter()
    always = Tracing(TracingConfig(sample_ratio=1.0), exporter=exporter)
    always.start_span("gateway request", None, links=[link]).end()
    (span,) = finished(always, exporter).values()
    assert span.context.trace_id != link.context.trace_id and span.parent is None
    assert [linked.context.span_id for linked in span.links] == [link.context.span_id]
