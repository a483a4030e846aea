"""One request through `modelship up` with tracing to a file and JSON logs: one trace whose
spans nest gateway request -> upstream attempt -> replica request -> engine queue, prefill
and decode, across the gateway's and the replica's processes; log lines that are JSON
objects naming the request, its tenant, release and variant, and its trace."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from modelship.gateway import hash_api_key
from modelship.storage import Storage

from fleet_process import UpProcess
from fleet_storage import publish_release

SLUG = "tiny"
KEY = "sk-trace-alpha"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    workdir = tmp_path_factory.mktemp("trace-fleet")
    storage = Storage(workdir / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, tiny_llama_dir, "fp16"))
    config = {
        "serve": {"engine": {"max_model_len": 128, "kv_cache_memory_mb": 8}},
        "gateway": {"tenants": [{"name": "alpha", "api_key_sha256": hash_api_key(KEY)}]},
        "autoscale": {"min_replicas": 1, "max_replicas": 1},
        "tracing": {"exporter": "file", "file": str(workdir / "spans.jsonl")},
        "log_format": "json",
    }
    # The SDK's own variable, inherited by the replicas: export batches every 100 ms.
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    try:
        up = UpProcess(config, storage.root, SLUG, workdir)
    finally:
        if saved is None:
            del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved
    up.spans_path = workdir / "spans.jsonl"
    up.replica_log_dir = storage.model_dir(SLUG) / "fleet"
    try:
        up.wait_ready()
        yield up
    finally:
        assert up.stop() == 0, up.log()[-3000:]


def spans_of(path: Path, trace_id: str, count: int, timeout_s: float = 30.0) -> list[dict]:
    """The trace's spans from the file, once `count` of them are there."""
    deadline = time.monotonic() + timeout_s
    spans: list[dict] = []
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        spans = [s for s in map(json.loads, lines) if s["trace_id"] == trace_id]
        if len(spans) >= count:
            return spans
        time.sleep(0.1)
    raise AssertionError(f"{len(spans)} spans of trace {trace_id} after {timeout_s}s: {spans}")


def json_lines(text: str) -> list[dict]:
    entries = []
    for line in text.splitlines():
        if line.startswith("{"):
            entries.append(json.loads(line))
    return entries


def test_one_request_makes_one_trace_nested_across_processes(fleet: UpProcess) -> None:
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=KEY, max_retries=0)
    stream = client.completions.create(
        model=SLUG, prompt="Tracing one request", max_tokens=4, temperature=0, stream=True,
        extra_headers={"x-request-id": "trace-req-1"},
    )  # fmt: skip
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) is not None

    # The access line names the trace; the trace's spans come from both processes.
    access = [e for e in json_lines(fleet.log()) if e.get("request_id") == "trace-req-1"]
    deadline = time.monotonic() + 10
    while not access and time.monotonic() < deadline:
        time.sleep(0.1)
        access = [e for e in json_lines(fleet.log()) if e.get("request_id") == "trace-req-1"]
    (line,) = access
    assert line["logger"] == "modelship.access" and line["level"] == "INFO"
    assert (line["tenant"], line["release"], line["variant"], line["status"]) == (
        "alpha", "1", "fp16", 200,
    )  # fmt: skip
    spans = spans_of(fleet.spans_path, line["trace_id"], count=6)
    by_name = {span["name"]: span for span in spans}
    assert sorted(by_name) == sorted([
        "gateway request", "upstream attempt", "replica request",
        "engine.queue", "engine.prefill", "engine.decode",
    ])  # fmt: skip
    assert len(spans) == 6  # one of each: one attempt, one request at the replica

    def parent_of(name: str) -> str | None:
        parent_id = by_name[name]["parent_span_id"]
        return next((s["name"] for s in spans if s["span_id"] == parent_id), parent_id)

    assert parent_of("gateway request") is None
    assert parent_of("upstream attempt") == "gateway request"
    assert parent_of("replica request") == "upstream attempt"
    for phase in ("engine.queue", "engine.prefill", "engine.decode"):
        assert parent_of(phase) == "replica request"
    assert line["span_id"] == by_name["gateway request"]["span_id"]
    assert by_name["gateway request"]["service"] == "modelship-gateway"
    assert by_name["replica request"]["service"] == "modelship-replica"

    gateway = by_name["gateway request"]["attributes"]
    assert gateway["tenant"] == "alpha" and gateway["model"] == SLUG
    assert (gateway["release"], gateway["variant"], gateway["status"]) == ("1", "fp16", 200)
    assert gateway["priority"] == "normal" and gateway["attempts"] == 1
    assert by_name["replica request"]["attributes"]["request_id"] == "trace-req-1"
    assert by_name["engine.prefill"]["attributes"]["prompt_tokens"] > 0
    assert by_name["engine.decode"]["attributes"]["output_tokens"] == 4
    assert by_name["engine.decode"]["attributes"]["finish_reason"] == "length"
    # Each span inside its parent's time, the phases back to back.
    for child in ("upstream attempt", "replica request", "engine.queue", "engine.decode"):
        span, parent = by_name[child], by_name[parent_of(child)]
        assert parent["start_ns"] <= span["start_ns"] <= span["end_ns"] <= parent["end_ns"]
    assert by_name["engine.queue"]["end_ns"] == by_name["engine.prefill"]["start_ns"]
    assert by_name["engine.prefill"]["end_ns"] == by_name["engine.decode"]["start_ns"]


def test_replica_log_lines_are_json(fleet: UpProcess) -> None:
    (log,) = fleet.replica_log_dir.glob("*.log")
    entries = json_lines(log.read_text())
    assert any(e["message"].startswith("ready: serving") for e in entries), log.read_text()
    assert all({"time", "level", "logger", "message"} <= e.keys() for e in entries)
