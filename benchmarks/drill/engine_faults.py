"""Drill 3, engine faults, on `modelship serve` with the engine core on a thread and in
its own process:

- a request whose processing raises inside the step (`MODELSHIP_INJECT_FAULTS` raise=,
  `engine/faults.py`) fails alone: 500 with an OpenAI error body (an error event when
  streamed); the streams beside it finish, and the server goes on serving;
- KV exhaustion: long prompts that cannot all fit the cache at once are preempted and
  recomputed, never crash, and all finish;
- a wedged step (wedge=) is detected: within the stall timeout /ready and /health answer
  503 "stalled", so a router stops sending it requests and a supervisor restarts it.

Prompts are token ids, so only the drill's own fault prompts hold the fault tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time

import httpx

from modelship.engine.faults import FAULTS_ENV

from drill.common import DrillContext, DrillResult, is_openai_error, metric, wait_until
from server_process import ServerProcess

STALL_TIMEOUT_S = 3.0


def run(context: DrillContext) -> DrillResult:
    result = DrillResult("engine_faults")
    vocab = json.loads((context.model_dir / "config.json").read_text())["vocab_size"]
    raise_token, wedge_token = vocab - 1, vocab - 2
    prompts = _prompts(vocab - 3, 8, 24)
    for placement in ("thread", "process"):
        _poison_request(context, placement, prompts, raise_token, result)
    _kv_exhaustion(context, prompts, result)
    _wedge(context, prompts, wedge_token, result)
    return result


def _prompts(max_id: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, max_id) for _ in range(length)] for _ in range(count)]


def _serve(context: DrillContext, faults: str | None, *args: str) -> ServerProcess:
    """A server whose engine injects `faults` (the variable reaches the core through the
    environment the server inherits)."""
    saved = os.environ.get(FAULTS_ENV)
    if faults:
        os.environ[FAULTS_ENV] = faults
    try:
        return ServerProcess(
            context.model_dir, "--served-model-name", "m", "--max-model-len", "256", *args
        )
    finally:
        if saved is None:
            os.environ.pop(FAULTS_ENV, None)
        else:
            os.environ[FAULTS_ENV] = saved


def _complete(url: str, prompt: list[int], max_tokens: int, stream: bool = False, timeout=120):
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def _stream_finishes(url: str, prompt: list[int], max_tokens: int) -> str:
    """The finish reason of a streamed completion; "error: ..." for an error event or an
    error status with an OpenAI error body (a request that fails before its first token)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    finish = "none"
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200:  # failed before its first token: a plain error
            response.read()
            return f"error: http {response.status_code}" if is_openai_error(response) else "bad"
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return f"error: {event['error'].get('message', '')}"
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
    return finish


def _poison_request(
    context: DrillContext, placement: str, prompts, raise_token: int, result: DrillResult
) -> None:
    server = _serve(context, f"raise={raise_token}", "--engine-core", placement)
    try:
        finishes: list[str] = []
        streams = [
            threading.Thread(
                target=lambda p=p: finishes.append(_stream_finishes(server.url, p, 48))
            )
            for p in prompts[:3]
        ]
        for thread in streams:
            thread.start()
        time.sleep(0.5)  # the streams are decoding when the poison arrives
        poison = [*prompts[3][:10], raise_token, *prompts[3][10:]]
        refused = _complete(server.url, poison, 8)
        poison_stream = _stream_finishes(server.url, poison, 8)
        for thread in streams:
            thread.join(timeout=120)
        result.check(
            f"{placement}: the failing request gets a 500 with an OpenAI error body",
            refused.status_code == 500 and is_openai_error(refused),
            f"{refused.status_code} {refused.text[:200]}",
        )
        result.check(
            f"{placement}: streamed, it ends with an error (event or status)",
            poison_stream.startswith("error"),
            poison_stream,
        )
        result.check(
            f"{placement}: the streams beside it finish",
            finishes == ["length"] * 3,
            str(finishes),
        )
        after = _complete(server.url, prompts[4], 4)
        result.check(
            f"{placement}: the server goes on serving",
            after.status_code == 200 and httpx.get(f"{server.url}/health").status_code == 200,
            f"{after.status_code} {after.text[:200]}",
        )
        result.check(
            f"{placement}: no KV blocks held afterwards",
            wait_until(lambda: metric(server.url, "modelship:kv_cache_usage_perc") == 0, 10),
        )
    finally:
        server.stop()


def _kv_exhaustion(context: DrillContext, prompts, result: DrillResult) -> None:
    """Requests of 240 tokens (120 prompt + 120 output) whose sum is ~1.5x what the KV
    cache holds (sized from the model's shape, fp32 cache): they take turns through
    preemption and recomputation."""
    config = json.loads((context.model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_token = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads)
    per_token *= head_dim * 4
    budget_mb = max(1, -(-int(2.5 * 240 * per_token) // 2**20))
    capacity = budget_mb * 2**20 // per_token
    count = min(16, -(-int(1.5 * capacity) // 240) + 1)
    server = _serve(context, None, "--kv-cache-memory-mb", str(budget_mb), "--max-num-seqs",
                    "16")  # fmt: skip
    try:
        codes: list[int] = []
        rng = random.Random(11)
        requests = [[rng.choice(p) for _ in range(120)] for p in (prompts * 2)[:count]]

        def ask(prompt: list[int]) -> None:
            codes.append(_complete(server.url, prompt, 120, timeout=600).status_code)

        threads = [threading.Thread(target=ask, args=(p,)) for p in requests]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        preemptions = metric(server.url, "modelship:num_preemptions_total")
        result.figures["kv_capacity_tokens"] = int(capacity)
        result.figures["kv_demand_tokens"] = 240 * count
        result.figures["kv_preemptions"] = int(preemptions)
        result.check("KV exhaustion: requests were preempted", preemptions > 0)
        result.check("KV exhaustion: every request finishes", codes == [200] * count, str(codes))
        result.check("KV exhaustion: the server is alive",
                     httpx.get(f"{server.url}/health").status_code == 200)  # fmt: skip
    finally:
        server.stop()


def _wedge(context: DrillContext, prompts, wedge_token: int, result: DrillResult) -> None:
    server = _serve(context, f"wedge={wedge_token}", "--stall-timeout", str(STALL_TIMEOUT_S),
                    "--engine-core", "process")  # fmt: skip
    try:
        wedged = [*prompts[5][:10], wedge_token]

        def send() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server is killed under it
                _complete(server.url, wedged, 4, False, 60)

        threading.Thread(target=send, daemon=True).start()
        started = time.monotonic()
        detected = wait_until(
            lambda: httpx.get(f"{server.url}/ready", timeout=2).status_code == 503, 60
        )
        seconds = time.monotonic() - started
        ready = httpx.get(f"{server.url}/ready", timeout=5)
        health = httpx.get(f"{server.url}/health", timeout=5)
        result.figures["wedge_detected_s"] = round(seconds, 1)
        result.check(
            "wedged step: /ready and /health answer 503 'stalled'",
            detected and ready.json().get("status") == "stalled" and health.status_code == 503,
            f"after {seconds:.1f}s: ready {ready.status_code} {ready.text}, health "
            f"{health.status_code}",
        )
    finally:
        server.kill()
        server.stop(timeout_s=5)
