"""Brown-out under a burst: a load of 3x the primary tier's capacity for 60 s, with the
brown-out off and on, on the same fleet.

    .venv/bin/python benchmarks/brownout.py [--storage modelship-data] [--duration 60]
        [--overload 3] [--cheap gptq]

Needs the demo model's optimized `fp16` and `--cheap` variants (`modelship run demo
--no-serve` builds them). A scratch model under --workdir serves fp16 as its production
release (the primary tier) and the cheap variant as the `economy` tier, one replica each
(the variants' files are hard-linked, not copied). First the primary's capacity C is
measured: requests/s with `max_in_flight_per_replica` requests in flight, closed loop, for
--capacity-s. Then the same seeded open-loop burst runs twice, brown-out off, then on:
Poisson arrivals at --overload x C for --duration seconds from three tenants (low, normal,
and high priority with `allow_degraded: false`, weights 2:1:1), each a chat request for
--max-tokens tokens. Reported per run: sent, served, refused (503/429), failed, the
variants that served, latency p50/p95 of what was served (end to end, non-streaming), and
the high-priority tenant's own. Prints a table and writes JSON (default
benchmarks/results/brownout.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import httpx

from modelship.gateway import hash_api_key
from modelship.pipeline.acquire import DEMO_SLUG
from modelship.storage import Storage
from modelship.storage.store import link_tree
from processes import UpFleet

SLUG = "brownout-bench"
PER_REPLICA = 8  # brownout.max_in_flight_per_replica, and the autoscaler's target
TENANTS = {  # name: (key, priority, weight)
    "batch": ("sk-bench-batch", "low", 2),
    "standard": ("sk-bench-standard", "normal", 1),
    "premium": ("sk-bench-premium", "high", 1),
}
WORDS = ["replica", "cache", "token", "route", "burst", "tier", "variant", "queue", "model"]


def prepare(storage: Storage, workdir: Path, cheap: str) -> Storage:
    """A scratch storage: fp16 as the production release, `cheap` as an optimized variant."""
    source = {name: storage.variant_dir(DEMO_SLUG, name) for name in ("fp16", cheap)}
    for folder in source.values():
        if not (folder / "manifest.json").is_file():
            raise SystemExit(f"{folder} is missing: run `modelship run demo --no-serve` first")
    scratch = Storage(workdir / "storage")
    if scratch.production_release(SLUG) is not None:
        return scratch
    artifact = scratch.release_dir(SLUG, 1)
    with (
        scratch.lock(artifact),
        scratch.publish(artifact, kind="release", source=str(source["fp16"]), revision=None,
                        inputs_hash="benchmark", extra={"variant": "fp16"}) as staging,
    ):  # fmt: skip
        link_tree(source["fp16"], staging)
    variant = scratch.variant_dir(SLUG, cheap)
    with (
        scratch.lock(variant),
        scratch.publish(variant, kind="optimized", source=str(source[cheap]), revision=None,
                        inputs_hash="benchmark", extra={"variant": cheap}) as staging,
    ):  # fmt: skip
        link_tree(source[cheap], staging)
    scratch.set_production(SLUG, 1)
    return scratch


def fleet_config(cheap: str, brownout: bool) -> dict:
    """fp16 on one replica, the economy tier on one, tenants of each priority."""
    tenants = [
        {"name": tenant, "api_key_sha256": hash_api_key(key), "priority": priority}
        | ({"allow_degraded": False} if priority == "high" else {})
        for tenant, (key, priority, _) in TENANTS.items()
    ]
    return {
        "serve": {"engine": {"max_model_len": 1024, "kv_cache_memory_mb": 256}},
        "gateway": {
            "tenants": tenants,
            "tiers": [{"name": "economy", "variant": cheap}],
            "brownout": {"enabled": brownout, "max_in_flight_per_replica": PER_REPLICA},
            "drift_probe": {"enabled": False},
        },
        "autoscale": {"min_replicas": 1, "max_replicas": 1, "target_concurrency": PER_REPLICA},
    }


def prompt(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": " ".join(rng.choices(WORDS, k=24)) + "?"}]


async def one(
    client: httpx.AsyncClient, url: str, tenant: str, messages: list[dict], max_tokens: int
) -> dict:
    key = TENANTS[tenant][0]
    body = {"model": SLUG, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    started = time.perf_counter()
    try:
        response = await client.post(f"{url}/v1/chat/completions", json=body,
                                     headers={"authorization": f"Bearer {key}"})  # fmt: skip
        status = response.status_code
        variant = response.headers.get("x-modelship-variant")
    except httpx.HTTPError as exc:
        status, variant = type(exc).__name__, None
    return {"tenant": tenant, "status": status, "variant": variant,
            "latency_s": time.perf_counter() - started}  # fmt: skip


async def capacity(url: str, seconds: float, max_tokens: int) -> float:
    """Requests/s the primary serves with PER_REPLICA in flight (low priority, brown-out
    off: all on the primary)."""
    rng = random.Random(1)
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            result = await one(client, url, "batch", prompt(rng), max_tokens)
            done += result["status"] == 200

    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, url, "batch", prompt(rng), max_tokens)  # warm
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(PER_REPLICA)))
        return done / (time.perf_counter() - started)


def schedule(rate: float, seconds: float, seed: int) -> list[tuple[float, str, list[dict]]]:
    """(arrival time, tenant, messages) of every request: the same for both runs."""
    rng = random.Random(seed)
    names = [name for name, (_, _, weight) in TENANTS.items() for _ in range(weight)]
    arrivals, at = [], 0.0
    while at < seconds:
        arrivals.append((at, rng.choice(names), prompt(rng)))
        at += rng.expovariate(rate)
    return arrivals


async def burst(url: str, arrivals: list[tuple[float, str, list[dict]]], max_tokens: int) -> dict:
    tasks = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        for at, tenant, messages in arrivals:
            delay = started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, url, tenant, messages, max_tokens)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
    return summarize(results, wall)


def summarize(results: list[dict], wall_s: float) -> dict:
    def latency(rows: list[dict]) -> dict:
        values = sorted(r["latency_s"] for r in rows)
        if not values:
            return {"p50_ms": None, "p95_ms": None}
        p95 = values[min(len(values) - 1, int(0.95 * len(values)))]
        return {"p50_ms": 1000 * statistics.median(values), "p95_ms": 1000 * p95}

    served = [r for r in results if r["status"] == 200]
    premium = [r for r in served if r["tenant"] == "premium"]
    return {
        "sent": len(results),
        "served": len(served),
        "refused": sum(r["status"] in (429, 503) for r in results),
        "failed": sum(r["status"] not in (200, 429, 503) for r in results),
        "by_variant": dict(Counter(r["variant"] for r in served)),
        "premium_variants": dict(Counter(r["variant"] for r in premium)),
        "sent_by_tenant": dict(Counter(r["tenant"] for r in results)),
        "refused_by_tenant": dict(
            Counter(r["tenant"] for r in results if r["status"] in (429, 503))
        ),
        "latency": latency(served),
        "premium_latency": latency(premium),
        "wall_s": wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", type=Path, default=Path("modelship-data"))
    parser.add_argument("--workdir", type=Path, default=Path("benchmarks/results/brownout-run"))
    parser.add_argument("--cheap", default="gptq", help="the economy tier's variant")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--overload", type=float, default=3.0)
    parser.add_argument("--capacity-s", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/brownout.json"))
    args = parser.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    storage = prepare(Storage(args.storage), args.workdir, args.cheap)
    results: dict = {"settings": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for enabled in (False, True):
        name = "brownout on" if enabled else "brownout off"
        config = fleet_config(args.cheap, enabled)
        fleet = UpFleet(config, storage.root, SLUG, args.workdir, name.replace(" ", "-"))
        try:
            fleet.wait_ready(2)  # the primary's replica and the economy tier's
            if not enabled:
                rate = asyncio.run(capacity(fleet.url, args.capacity_s, args.max_tokens))
                results["capacity_requests_s"] = rate
                burst_rate = args.overload * rate
                print(f"primary capacity: {rate:.2f} requests/s; burst at {burst_rate:.2f}/s "
                      f"for {args.duration:.0f}s", flush=True)  # fmt: skip
            rate = args.overload * results["capacity_requests_s"]
            arrivals = schedule(rate, args.duration, args.seed)
            print(f"{name}: bursting...", flush=True)
            results["runs"][name] = asyncio.run(burst(fleet.url, arrivals, args.max_tokens))
        finally:
            fleet.stop()

    print(f"\n{'run':<14}{'sent':>6}{'served':>8}{'refused':>9}{'failed':>8}{'p50':>9}"
          f"{'p95':>9}{'prem p95':>10}  served by variant")  # fmt: skip
    for name, r in results["runs"].items():
        lat, prem = r["latency"], r["premium_latency"]

        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.0f}ms"

        print(f"{name:<14}{r['sent']:>6}{r['served']:>8}{r['refused']:>9}{r['failed']:>8}"
              f"{ms(lat['p50_ms']):>9}{ms(lat['p95_ms']):>9}{ms(prem['p95_ms']):>10}  "
              f"{r['by_variant']} (premium: {r['premium_variants']})")  # fmt: skip
        print(f"{'':<14}sent by tenant {r['sent_by_tenant']}, refused {r['refused_by_tenant']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
