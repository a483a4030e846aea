"""Routing benchmark: multi-turn chat over a fleet, round_robin vs least_outstanding_tokens
vs prefix_affinity, plus the gateway's own overhead; under `modelship up` and, with
`--fleets up discovery`, side by side through the standalone gateway finding its replicas
in the Kubernetes API.

    .venv/bin/python benchmarks/routing.py [--replicas 2] [--conversations 24] [--turns 4]
        [--policies round_robin prefix_affinity] [--fleets up discovery]

For each policy and fleet a fresh fleet of --replicas replicas of the production release
of the demo model (so no run inherits another's KV caches) serves the same seeded
workload. The fleets: `up`, `modelship up` (min = max = --replicas; the drift probe off,
as its requests bypass routing); `discovery`, `modelship gateway` with `gateway.discovery`
pointed at a stand-in Kubernetes API server (`kube_stand_in.py`) in which each of
--replicas `modelship serve` processes (started with the options `up` gives its own) is a
ready pod of a headless Service, as the rendered gateway finds the engine pods. Both
fleets use one API key (`serve.api_key`: the gateway's and the replicas'). The workload:
--conversations chats sharing one system prompt, --concurrency of them at a time, each
turn resending the whole history (the real previous answers included) as a streaming chat
request. Reported per policy and fleet: prefix-cache hit rate (cached prompt tokens /
prompt tokens, from the replicas' /metrics) next to its ceiling (perfect affinity on the
same prompts and answers: `ceiling_hit_rate`), TTFT p50/p95 (first content chunk), output
tok/s, requests/s, and load imbalance (mean over 100 ms samples, taken while any request
runs, of max/mean of running + waiting across replicas; `imbalance_busy` in the JSON
counts only the samples taken while all --concurrency requests run, `load_samples` holds
every sample). Then the gateway's overhead: the same 1-token request sent alternately to a
replica (each in turn) and through the gateway (on the last policy's fleet of each kind).
Prints one table, the fleets' rows of each policy next to each other, and writes JSON
(default benchmarks/results/routing.json: `runs[fleet][policy]`, `overhead[fleet]`,
`targets`).
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

from modelship.engine.options import EngineOptions
from modelship.engine.tokenizer import load_tokenizer
from modelship.gateway import hash_api_key
from modelship.pipeline.acquire import DEMO_SLUG, acquire
from modelship.storage import Storage
from modelship.storage.store import link_tree
from processes import DiscoveryFleet, GatewayFleet, UpFleet

POLICIES = ("round_robin", "least_outstanding_tokens", "prefix_affinity")
FLEETS = ("up", "discovery")
API_KEY = "sk-routing-benchmark"
WORDS = [
    "cache",
    "block",
    "replica",
    "token",
    "route",
    "prefix",
    "latency",
    "batch",
    "kernel",
    "queue",
    "scheduler",
    "tenant",
    "gateway",
    "stream",
    "model",
    "weight",
    "release",
    "canary",
    "metric",
    "budget",
    "memory",
    "window",
    "request",
]


def ensure_release(storage: Storage) -> None:
    """The demo model with a production release (the base published as one if needed)."""
    acquire("demo", storage)
    if storage.production_release(DEMO_SLUG) is not None:
        return
    artifact = storage.release_dir(DEMO_SLUG, 1)
    with (
        storage.lock(artifact),
        storage.publish(
            artifact, kind="release", source="base", revision=None, inputs_hash="benchmark",
            extra={"variant": "base"},
        ) as staging,
    ):  # fmt: skip
        link_tree(storage.base_dir(DEMO_SLUG), staging)
    storage.set_production(DEMO_SLUG, 1)


def start_fleet(
    kind: str, storage: Storage, workdir: Path, policy: str, replicas: int
) -> GatewayFleet:
    """The demo model's production release on `replicas` replicas under `policy`, behind
    `modelship up` (`kind` up) or the standalone gateway with discovery (`discovery`)."""
    engine = {"max_model_len": 2048, "kv_cache_memory_mb": 256}
    config = {
        "serve": {"engine": engine, "api_key": API_KEY},
        "gateway": {
            "routing": {"policy": policy},
            # No drift probe: it asks every replica its golden prompts as soon as it is
            # ready, directly (no routing), i.e. during the workload: load no policy sees.
            "drift_probe": {"enabled": False},
            "metrics_api_key_sha256": hash_api_key(API_KEY),  # the routing decisions
        },
        "autoscale": {"min_replicas": replicas, "max_replicas": replicas},
    }
    name = f"{kind}-{policy}"
    if kind == "up":
        return UpFleet(config, storage.root, DEMO_SLUG, workdir, name)
    release = storage.production_release(DEMO_SLUG)
    return DiscoveryFleet(config, storage.release_dir(DEMO_SLUG, release), DEMO_SLUG,
                          workdir, name, replicas, str(release))  # fmt: skip


def make_conversations(num: int, turns: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [[" ".join(rng.choices(WORDS, k=60)) + "?" for _ in range(turns)] for _ in range(num)]


async def chat_turn(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int):
    """One streamed turn: (ttft_s, answer text, output chunks)."""
    started = time.perf_counter()
    ttft, parts = None, []
    body = {"model": DEMO_SLUG, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            content = choices[0].get("delta", {}).get("content")
            if content:
                ttft = ttft if ttft is not None else time.perf_counter() - started
                parts.append(content)
    return ttft if ttft is not None else time.perf_counter() - started, "".join(parts), len(parts)


async def run_workload(
    fleet: GatewayFleet, tokenizer, conversations, system: str, concurrency: int, max_tokens
):
    replica_urls = fleet.replica_urls()
    ttfts: list[float] = []
    num_chunks = 0
    imbalance: list[float] = []
    imbalance_busy: list[float] = []  # only while all --concurrency requests run
    load_samples: list[list[float]] = []  # running + waiting per replica, each sample
    done = asyncio.Event()

    async def sample(client: httpx.AsyncClient) -> None:
        while not done.is_set():
            loads = []
            for url in replica_urls:
                text = (await client.get(f"{url}/metrics")).text
                loads.append(sum(
                    float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith(("modelship:num_requests_running",
                                        "modelship:num_requests_waiting"))
                ))  # fmt: skip
            load_samples.append(loads)
            if sum(loads) > 0:
                imbalance.append(max(loads) / (sum(loads) / len(loads)))
                if sum(loads) >= concurrency:
                    imbalance_busy.append(imbalance[-1])
            await asyncio.sleep(0.1)

    transcripts: list[list[dict]] = []

    async def conversation(client, semaphore, turns) -> None:
        nonlocal num_chunks
        async with semaphore:
            messages = [{"role": "system", "content": system}]
            transcripts.append(messages)
            for user in turns:
                messages.append({"role": "user", "content": user})
                ttft, answer, chunks = await chat_turn(client, fleet.url, messages, max_tokens)
                ttfts.append(ttft)
                num_chunks += chunks
                messages.append({"role": "assistant", "content": answer})

    before = [fleet.metrics(url) for url in replica_urls]
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, headers=fleet.headers) as client:
        sampler = asyncio.create_task(sample(client))
        started = time.perf_counter()
        await asyncio.gather(*(conversation(client, semaphore, t) for t in conversations))
        seconds = time.perf_counter() - started
        done.set()
        await sampler
    after = [fleet.metrics(url) for url in replica_urls]
    hits = sum(a["modelship:prefix_cache_hits_total"] - b["modelship:prefix_cache_hits_total"]
               for a, b in zip(after, before, strict=True))  # fmt: skip
    queries = sum(
        a["modelship:prefix_cache_queries_total"] - b["modelship:prefix_cache_queries_total"]
        for a, b in zip(after, before, strict=True)
    )
    ttfts.sort()
    # What each replica finished: their sum against this run's turns shows whether the
    # replicas served requests beyond the client's.
    finished = "modelship:request_success_total"
    replica_requests = [
        a.get(finished, 0.0) - b.get(finished, 0.0) for a, b in zip(after, before, strict=True)
    ]
    decisions = {  # by reason: how often affinity held, and how often the load bound moved
        sample.labels.get("reason", ""): sample.value
        for family in text_string_to_metric_families(
            httpx.get(f"{fleet.url}/metrics", headers=fleet.headers).text
        )
        for sample in family.samples
        if sample.name == "modelship_gateway_routing_decisions_total"
    }
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p95_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        "output_tok_s": num_chunks / seconds,
        "requests_s": len(ttfts) / seconds,
        "imbalance": statistics.fmean(imbalance) if imbalance else 1.0,
        "imbalance_busy": statistics.fmean(imbalance_busy) if imbalance_busy else 1.0,
        "load_samples": load_samples,
        "replica_requests": replica_requests,
        "seconds": seconds,
        "num_requests": len(ttfts),
        "routing_decisions": decisions,
        "ceiling_hit_rate": ceiling_hit_rate(tokenizer, transcripts),
    }


def ceiling_hit_rate(tokenizer, transcripts: list[list[dict]]) -> float:
    """The hit rate of perfect affinity on this run's prompts: each turn finds cached the
    longer of its conversation's previous prompt plus answer, and the prefix all first
    turns share (the system prompt), in whole KV blocks and never the prompt's last token
    (the engine computes at least one). What no routing policy can beat."""

    def ids(messages: list[dict]) -> list[int]:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)  # fmt: skip
        return tokenizer(rendered, add_special_tokens=False).input_ids

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    firsts = [ids(t[:2]) for t in transcripts if len(t) > 1]
    shared = min((common(firsts[0], other) for other in firsts[1:]), default=0)
    block = EngineOptions().block_size
    total = cached = 0
    for transcript in transcripts:
        previous: list[int] = []
        for turn in range(1, len(transcript), 2):  # system, (user, assistant)...
            prompt = ids(transcript[: turn + 1])
            answer = transcript[turn + 1]["content"] if turn + 1 < len(transcript) else ""
            found = min(max(common(prompt, previous), min(shared, len(prompt))), len(prompt) - 1)
            total += len(prompt)
            cached += found // block * block
            previous = prompt + tokenizer(answer, add_special_tokens=False).input_ids
    return cached / total if total else 0.0


def gateway_overhead(fleet: GatewayFleet, num: int) -> dict:
    """The direct requests take turns over every replica, as the gateway's do (an under-one-
    block prompt goes to the least loaded, ties rotating): a replica that was idle answers
    its next request later than a busy one does, which is not the gateway's doing."""
    replicas = fleet.replica_urls()
    body = {"model": DEMO_SLUG, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1, "temperature": 0}  # fmt: skip
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    with httpx.Client(timeout=60, headers=fleet.headers) as client:
        for i in range(num + 10):
            replica = replicas[i % len(replicas)]
            for name, url in (("direct", replica), ("gateway", fleet.url)):
                started = time.perf_counter()
                client.post(f"{url}/v1/chat/completions", json=body).raise_for_status()
                if i >= 10:  # warm-up
                    times[name].append(time.perf_counter() - started)
    result = {f"{k}_p50_ms": 1000 * statistics.median(v) for k, v in times.items()}
    result |= {f"{k}_p95_ms": 1000 * sorted(v)[int(0.95 * len(v))] for k, v in times.items()}
    result["added_p50_ms"] = result["gateway_p50_ms"] - result["direct_p50_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", type=Path, default=Path("modelship-data"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--overhead-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                        help="the policies to run, in this order (the overhead is measured on "
                        "the last one's fleet)")  # fmt: skip
    parser.add_argument("--fleets", nargs="+", choices=FLEETS, default=["up"],
                        help="up: `modelship up`; discovery: the standalone gateway finding "
                        "its replicas in a stand-in Kubernetes API. Each policy runs on each, "
                        "in turn")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/routing.json"))
    args = parser.parse_args()

    storage = Storage(args.storage)
    ensure_release(storage)
    release = storage.release_dir(DEMO_SLUG, storage.production_release(DEMO_SLUG))
    tokenizer = load_tokenizer(release)  # the replicas' own
    workdir = args.out.parent / "routing-logs"
    workdir.mkdir(parents=True, exist_ok=True)
    system = "You are a concise assistant for an inference platform. " * 6
    conversations = make_conversations(args.conversations, args.turns, args.seed)
    results: dict = {"settings": vars(args) | {"storage": str(args.storage),
                                              "out": str(args.out)},
                     "runs": {kind: {} for kind in args.fleets}, "overhead": {}}  # fmt: skip
    fleet = None
    try:
        for policy in args.policies:  # the fleets in turn: a load change hits both alike
            for kind in args.fleets:
                fleet = start_fleet(kind, storage, workdir, policy, args.replicas)
                fleet.wait_ready(args.replicas)
                turns = len(conversations) * args.turns
                print(f"{kind} {policy}: running {turns} turns...", flush=True)
                results["runs"][kind][policy] = asyncio.run(run_workload(
                    fleet, tokenizer, conversations, system, args.concurrency, args.max_tokens
                ))  # fmt: skip
                if policy == args.policies[-1] and args.overhead_requests > 0:
                    results["overhead"][kind] = gateway_overhead(fleet, args.overhead_requests)
                fleet.stop()
                fleet = None
    finally:
        if fleet is not None:
            fleet.stop()

    print(f"\n{'policy':<26}{'fleet':<11}{'hit rate':>9}{'ceiling':>9}{'TTFT p50':>10}"
          f"{'TTFT p95':>10}{'tok/s':>8}{'req/s':>7}{'max/mean':>10}")  # fmt: skip
    for policy in args.policies:
        for kind in args.fleets:
            r = results["runs"][kind][policy]
            print(f"{policy:<26}{kind:<11}{r['hit_rate']:>9.1%}{r['ceiling_hit_rate']:>9.1%}"
                  f"{r['ttft_p50_ms']:>8.0f}ms{r['ttft_p95_ms']:>8.0f}ms{r['output_tok_s']:>8.1f}"
                  f"{r['requests_s']:>7.2f}{r['imbalance']:>10.2f}")  # fmt: skip
    for kind, o in results["overhead"].items():
        print(f"\n{kind} gateway overhead: direct p50 {o['direct_p50_ms']:.2f} ms, through the "
              f"gateway p50 {o['gateway_p50_ms']:.2f} ms: +{o['added_p50_ms']:.2f} ms")  # fmt: skip
    targets = {}
    for kind, runs in results["runs"].items():
        rr, pa = runs.get("round_robin"), runs.get("prefix_affinity")
        if rr is not None and pa is not None:
            targets[f"{kind}: hit rate >= 2x round_robin"] = pa["hit_rate"] >= 2 * rr["hit_rate"]
            targets[f"{kind}: TTFT p95 >= 1.5x lower than round_robin"] = (
                rr["ttft_p95_ms"] >= 1.5 * pa["ttft_p95_ms"]
            )
        if pa is not None:
            targets[f"{kind}: prefix_affinity max/mean <= 1.3"] = pa["imbalance"] <= 1.3
        if kind in results["overhead"]:
            added = results["overhead"][kind]["added_p50_ms"]
            targets[f"{kind}: gateway adds <= 2 ms at p50"] = added <= 2.0
    results["targets"] = targets
    for name, met in targets.items():
        print(f"  {'met ' if met else 'MISS'} {name}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
