"""Time to capacity: a step of load on one replica, with and without a warm pool.

    .venv/bin/python benchmarks/scale_out.py [--storage modelship-data] [--concurrency 8]
        [--seconds 30]

`modelship up` serves the demo model's production release with `min_replicas: 1`,
`max_replicas: 2` and `target_concurrency` half of --concurrency, so the step asks for a
second replica; once with `warm_pool: 0` (the second replica is started when the load comes)
and once with `warm_pool: 1` (it is already loaded and out of routing). The load: from idle,
--concurrency streaming chats at once, closed loop, for --seconds. Reported per run: time
from the step to two replicas in routing (polled), the supervisor's own
`scale_out_seconds` (from the autoscaler asking to a replica taking traffic) and its source
(warm or cold), and TTFT p50/p95 of the requests started in the first 10 s and over the
whole run. Prints a table and writes JSON (default benchmarks/results/scale_out.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from modelship.pipeline.acquire import DEMO_SLUG
from modelship.storage import Storage
from processes import UpFleet
from routing import ensure_release

WORDS = ["replica", "warm", "pool", "scale", "token", "cache", "queue", "load", "ready"]


def gauges(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the gateway's /metrics by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def count(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()
    )


def wait_for(url: str, routed: int, standby: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            samples = gauges(url)
            ready = count(samples, "modelship_gateway_replicas", state="ready")
            warm = count(samples, "modelship_gateway_replicas", state="standby")
            if (ready, warm) == (routed, standby):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"no {routed} routed + {standby} warm replicas after {timeout_s:.0f}s")


async def step_load(url: str, concurrency: int, seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    ttfts: list[tuple[float, float]] = []  # (started, ttft) relative to the step
    reached_at: float | None = None
    started = time.perf_counter()
    stop_at = started + seconds

    async def worker(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < stop_at:
            content = " ".join(rng.choices(WORDS, k=40)) + "?"
            body = {"model": DEMO_SLUG, "messages": [{"role": "user", "content": content}],
                    "max_tokens": 32, "temperature": 0, "stream": True}  # fmt: skip
            sent = time.perf_counter()
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                ttft = None
                async for line in r.aiter_lines():
                    if ttft is None and '"content":"' in line and line.startswith("data: "):
                        ttft = time.perf_counter() - sent
            ttfts.append((sent - started, ttft if ttft is not None else time.perf_counter() - sent))

    async def watch(client: httpx.AsyncClient) -> None:
        nonlocal reached_at
        while reached_at is None and time.perf_counter() < stop_at:
            text = (await client.get(f"{url}/metrics")).text
            ready = sum(
                s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "modelship_gateway_replicas" and s.labels.get("state") == "ready"
            )
            if ready >= 2:
                reached_at = time.perf_counter() - started
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(watch(client), *(worker(client) for _ in range(concurrency)))

    def quantiles(values: list[float]) -> dict:
        values = sorted(values)
        if not values:
            return {"p50_ms": None, "p95_ms": None, "n": 0}
        p95 = values[min(len(values) - 1, int(0.95 * len(values)))]
        return {"p50_ms": 1000 * statistics.median(values), "p95_ms": 1000 * p95, "n": len(values)}

    return {
        "two_routed_after_s": reached_at,
        "ttft_first_10s": quantiles([t for s, t in ttfts if s < 10]),
        "ttft_all": quantiles([t for _, t in ttfts]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", type=Path, default=Path("modelship-data"))
    parser.add_argument("--workdir", type=Path, default=Path("benchmarks/results/scale-out-run"))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scale_out.json"))
    args = parser.parse_args()

    storage = Storage(args.storage)
    ensure_release(storage)
    args.workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"settings": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for warm_pool in (0, 1):
        config = {
            "serve": {"engine": {"max_model_len": 1024, "kv_cache_memory_mb": 128}},
            "gateway": {"drift_probe": {"enabled": False}},
            "autoscale": {
                "min_replicas": 1, "max_replicas": 2, "warm_pool": warm_pool,
                "target_concurrency": max(1, args.concurrency // 2), "scale_up_window_s": 1,
                "tick_s": 0.25,
            },
        }  # fmt: skip
        name = f"warm_pool={warm_pool}"
        fleet = UpFleet(config, storage.root, DEMO_SLUG, args.workdir, f"warm-pool-{warm_pool}")
        try:
            wait_for(fleet.url, routed=1, standby=warm_pool)
            before = gauges(fleet.url)  # the fleet's first replica: a cold scale-out too
            print(f"{name}: step of {args.concurrency} for {args.seconds:.0f}s...", flush=True)
            run = asyncio.run(step_load(fleet.url, args.concurrency, args.seconds, args.seed))
            run["scale_out"] = step_scale_outs(before, gauges(fleet.url))
            results["runs"][name] = run
        finally:
            fleet.stop()

    print(f"\n{'run':<14}{'2 routed after':>15}{'scale-out (src)':>18}{'TTFT p95 <10s':>15}"
          f"{'TTFT p95 all':>14}")  # fmt: skip
    for name, r in results["runs"].items():
        reached = r["two_routed_after_s"]
        reached_text = "never" if reached is None else f"{reached:.2f}s"
        scale_text = ", ".join(f"{v['mean_s']:.2f}s ({k})" for k, v in r["scale_out"].items())
        print(
            f"{name:<14}{reached_text:>15}{scale_text or '-':>18}"
            f"{r['ttft_first_10s']['p95_ms'] or 0:>13.0f}ms{r['ttft_all']['p95_ms'] or 0:>12.0f}ms"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


def step_scale_outs(before: dict, after: dict) -> dict[str, dict]:
    """The scale-outs during the step, by source, as the supervisor timed them: from the
    autoscaler asking for a replica to one taking traffic."""
    name = "modelship_gateway_scale_out_seconds"
    result = {}
    for source in ("warm", "cold"):
        n = count(after, f"{name}_count", source=source) - count(before, f"{name}_count",
                                                                 source=source)  # fmt: skip
        total = count(after, f"{name}_sum", source=source) - count(before, f"{name}_sum",
                                                                  source=source)  # fmt: skip
        if n:
            result[source] = {"count": n, "mean_s": total / n}
    return result


if __name__ == "__main__":
    main()
