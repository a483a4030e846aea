"""Drill 8, soak: mixed load through `modelship up` for `--soak-minutes` (20 by default;
only when asked for, never in `make test`), sampling every 10 s the fleet's resident
memory, open file descriptors and the replicas' KV cache usage.

Mixed load: streamed and whole completions and chats, short and long prompts, n=2,
logprobs, stop strings, clients that hang up mid-stream. Reported: the slope of each
series over the second half (after warm-up) by least squares, per minute. Pass: RSS grows
less than 4 MB/min, file descriptors less than 1/min, and once the load stops the KV
cache is empty again (nothing leaked by hung-up or failed requests).
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import psutil

from modelship.storage import Storage

from drill.common import DrillContext, DrillResult, metric, wait_until
from fleet_process import UpProcess
from fleet_storage import publish_release

SLUG = "drill"
WORDS = "paged attention reads keys and values through a block table of the cache".split()  # noqa: SIM905


def run(context: DrillContext) -> DrillResult:
    result = DrillResult("soak")
    storage = Storage(context.work_dir / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, context.model_dir, "fp16"))
    config = {
        "serve": {"engine": {"max_model_len": 512, "kv_cache_memory_mb": 64}},
        "autoscale": {"min_replicas": 2, "max_replicas": 2},
    }
    minutes = 1.0 if context.quick else context.soak_minutes
    up = UpProcess(config, storage.root, SLUG, context.work_dir)
    samples: list[tuple[float, int, int]] = []  # (minutes, rss bytes, fds)
    counts = {"ok": 0, "error": 0, "hung_up": 0}
    try:
        up.wait_ready(timeout_s=180)
        stop = time.monotonic() + minutes * 60
        workers = [
            threading.Thread(target=_client, args=(up.url, stop, seed, counts)) for seed in range(6)
        ]
        for worker in workers:
            worker.start()
        started = time.monotonic()
        while any(w.is_alive() for w in workers):
            rss, fds = _usage(up)
            samples.append(((time.monotonic() - started) / 60, rss, fds))
            time.sleep(10 if not context.quick else 2)
        urls = [up.replica_url(r) for r in up.replicas()]
        drained = wait_until(
            lambda: all(metric(u, "modelship:kv_cache_usage_perc") == 0 for u in urls), 30
        )
    finally:
        code = up.stop()
    later = samples[len(samples) // 2 :]
    rss_slope = _slope([(t, r / 2**20) for t, r, _ in later])
    fd_slope = _slope([(t, f) for t, _, f in later])
    result.figures.update(
        minutes=minutes,
        requests=counts,
        samples=len(samples),
        rss_mb_start_end=[samples[0][1] // 2**20, samples[-1][1] // 2**20] if samples else None,
        rss_mb_per_min=round(rss_slope, 2),
        fds_start_end=[samples[0][2], samples[-1][2]] if samples else None,
        fds_per_min=round(fd_slope, 2),
    )
    result.check("every request was answered", counts["ok"] > 0 and not counts["error"],
                 str(counts))  # fmt: skip
    result.check("RSS slope under 4 MB/min", rss_slope < 4, f"{rss_slope:.2f} MB/min")
    result.check("file descriptor slope under 1/min", fd_slope < 1, f"{fd_slope:.2f}/min")
    result.check("the KV cache is empty once the load stops", drained)
    result.check("the fleet stops cleanly", code == 0, f"exit {code}")
    return result


def _client(url: str, stop: float, seed: int, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < stop:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice((8, 20, 60))))
            chat = rng.random() < 0.5
            body: dict = {
                "model": SLUG,
                "max_tokens": rng.choice((4, 16, 48)),
                "temperature": rng.choice((0, 0.8)),
                "stream": rng.random() < 0.6,
            }
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body |= {
                    "prompt": prompt,
                    "logprobs": rng.choice((None, 2)),
                    "n": rng.choice((1, 1, 2)),
                    "stop": rng.choice((None, ["table"])),
                }
            path = "/v1/chat/completions" if chat else "/v1/completions"
            hang_up = body["stream"] and rng.random() < 0.2  # fmt: skip
            try:
                if body["stream"]:
                    with client.stream("POST", url + path, json=body) as response:
                        for i, _ in enumerate(response.iter_lines()):
                            if hang_up and i == 2:
                                break
                        ok = response.status_code == 200
                else:
                    ok = client.post(url + path, json=body).status_code == 200
            except httpx.HTTPError:
                ok = False
            key = "hung_up" if hang_up else ("ok" if ok else "error")
            counts[key] += 1


def _usage(up: UpProcess) -> tuple[int, int]:
    rss = fds = 0
    try:
        root = psutil.Process(up.process.pid)
        for process in [root, *root.children(recursive=True)]:
            rss += process.memory_info().rss
            fds += process.num_fds()
    except psutil.Error:
        pass
    return rss, fds


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 for fewer than two points)."""
    if len(points) < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
