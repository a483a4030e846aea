"""Drill 2, overload: 2x and 5x the fleet's capacity through `modelship up`.

The fleet is one replica (capacity = its `max_num_seqs` sequences at once) behind the
gateway, with two tenants: "bulk" (low priority) makes the load with closed-loop clients
streaming completions, "urgent" (high priority) sends one request at a time and measures
its time to first token. Pass rules:
- every request ends in a complete answer, or a 429/503 with Retry-After; none hangs
  past its client timeout, none gets anything else;
- the fleet's memory (gateway + replicas, RSS) stays under a stated bound;
- high priority is never refused while low priority is shed, and (full version only: a
  stopwatch is for the benchmark, not for `make test`) keeps its TTFT p95 within 2x of
  the unloaded value.
"""

from __future__ import annotations

import threading
import time

import httpx
import psutil

from modelship.gateway import hash_api_key
from modelship.storage import Storage

from drill.common import DrillContext, DrillResult, percentile
from fleet_process import UpProcess
from fleet_storage import publish_release

SLUG = "drill"
BULK_KEY, URGENT_KEY = "sk-drill-bulk-1", "sk-drill-urgent-2"
MAX_NUM_SEQS = 4
CLIENT_TIMEOUT_S = 60.0
PROMPT = "Continuous batching schedules requests at iteration granularity. "


def run(context: DrillContext) -> DrillResult:
    result = DrillResult("overload")
    storage = Storage(context.work_dir / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, context.model_dir, "fp16"))
    config = {
        "serve": {"engine": {"max_model_len": 256, "kv_cache_memory_mb": 64,
                             "max_num_seqs": MAX_NUM_SEQS, "max_waiting_requests": 8}},
        "gateway": {
            "tenants": [
                {"name": "bulk", "api_key_sha256": hash_api_key(BULK_KEY), "priority": "low"},
                {"name": "urgent", "api_key_sha256": hash_api_key(URGENT_KEY),
                 "priority": "high"},
            ],
            "admission": {"max_requests": 4 * MAX_NUM_SEQS},
        },
        "autoscale": {"min_replicas": 1, "max_replicas": 1},
    }  # fmt: skip
    duration = 8.0 if context.quick else 60.0
    up = UpProcess(config, storage.root, SLUG, context.work_dir)
    try:
        up.wait_ready(timeout_s=180)
        with httpx.Client() as client:
            baseline = [_stream(client, up.url, URGENT_KEY)
                        for _ in range(6 if context.quick else 20)]  # fmt: skip
        unloaded = [o.ttft for o in baseline if o.kind == "complete"]
        base_p95 = percentile(unloaded, 95)
        base_rss = _fleet_rss(up)
        bound = int(1.5 * base_rss + 512 * 2**20)
        result.figures["unloaded_ttft_p95_ms"] = round(base_p95 * 1000, 1)
        result.figures["rss_bound_mb"] = bound // 2**20
        result.check("unloaded: urgent requests complete", len(unloaded) == len(baseline))
        for factor in (2, 5):
            _level(up, factor, duration, base_p95, bound, context, result)
    finally:
        code = up.stop()
    result.check("the fleet stops cleanly", code == 0, f"exit {code}")
    return result


class Outcome:
    def __init__(self, kind: str, ttft: float = 0.0, detail: str = "") -> None:
        self.kind = kind  # complete, refused (429/503 with Retry-After), bad, timeout
        self.ttft = ttft
        self.detail = detail


def _stream(client: httpx.Client, url: str, key: str) -> Outcome:
    body = {"model": SLUG, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    started = time.monotonic()
    ttft = 0.0
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body,
                          headers={"authorization": f"Bearer {key}"},
                          timeout=CLIENT_TIMEOUT_S) as response:  # fmt: skip
            if response.status_code in (429, 503):
                response.read()
                if response.headers.get("retry-after"):
                    return Outcome("refused")
                return Outcome("bad", detail=f"{response.status_code} without Retry-After")
            if response.status_code != 200:
                response.read()
                return Outcome("bad", detail=f"{response.status_code} {response.text[:100]}")
            done = False
            for line in response.iter_lines():
                if line.startswith("data: ") and not ttft:
                    ttft = time.monotonic() - started
                if line == "data: [DONE]":
                    done = True
                if '"error"' in line:
                    return Outcome("bad", detail=line[:120])
            return Outcome("complete" if done else "bad", ttft, "" if done else "no [DONE]")
    except httpx.TimeoutException:
        return Outcome("timeout")
    except httpx.HTTPError as exc:
        return Outcome("bad", detail=f"{type(exc).__name__}: {exc}")


def _fleet_rss(up: UpProcess) -> int:
    processes = [psutil.Process(up.process.pid), *up.replicas()]
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
            total += sum(c.memory_info().rss for c in process.children(recursive=True))
        except psutil.Error:
            pass
    return total


def _level(up, factor, duration, base_p95, bound, context, result: DrillResult) -> None:
    stop = time.monotonic() + duration
    bulk: list[Outcome] = []
    urgent: list[Outcome] = []
    peak_rss = 0

    def client(key: str, sink: list[Outcome]) -> None:
        # One connection pool per client: a fresh httpx client per request (TLS context
        # and all) costs the load generator more CPU than the fleet it loads.
        with httpx.Client() as http:
            while time.monotonic() < stop:
                outcome = _stream(http, up.url, key)
                sink.append(outcome)
                if outcome.kind == "refused":
                    time.sleep(0.05)  # a polite client would wait Retry-After; this pushes

    threads = [threading.Thread(target=client, args=(BULK_KEY, bulk))
               for _ in range(factor * MAX_NUM_SEQS)]  # fmt: skip
    threads.append(threading.Thread(target=client, args=(URGENT_KEY, urgent)))
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        peak_rss = max(peak_rss, _fleet_rss(up))
        time.sleep(0.5)
    everything = bulk + urgent
    counts = {kind: sum(o.kind == kind for o in everything)
              for kind in ("complete", "refused", "bad", "timeout")}  # fmt: skip
    urgent_ttft = [o.ttft for o in urgent if o.kind == "complete"]
    p95 = percentile(urgent_ttft, 95)
    name = f"{factor}x"
    result.figures[f"{name}_outcomes"] = counts
    result.figures[f"{name}_urgent_ttft_p95_ms"] = round(p95 * 1000, 1)
    result.figures[f"{name}_ttft_ratio"] = round(p95 / base_p95, 2) if base_p95 else None
    result.figures[f"{name}_peak_rss_mb"] = peak_rss // 2**20
    bad = [o.detail for o in everything if o.kind in ("bad", "timeout")]
    result.check(f"{name}: every request completes or is refused with Retry-After",
                 not bad and counts["complete"] > 0, f"{counts}; {bad[:3]}")  # fmt: skip
    result.check(f"{name}: memory under {bound // 2**20} MB", peak_rss < bound,
                 f"peak {peak_rss // 2**20} MB")  # fmt: skip
    result.check(f"{name}: high priority is never refused",
                 bool(urgent) and all(o.kind == "complete" for o in urgent),
                 str([o.kind for o in urgent]))  # fmt: skip
    if not context.quick:
        result.check(f"{name}: high priority TTFT p95 within 2x unloaded", p95 <= 2 * base_p95,
                     f"{p95 * 1000:.0f} ms vs {base_p95 * 1000:.0f} ms unloaded")  # fmt: skip
