"""Serving behaviour of a variant: a real `modelship serve` replica under one workload.

Latency is measured alone (concurrency 1: TTFT and time per output token), throughput
under `concurrency` streams, both with the shared load generator (`modelship.loadgen`);
the golden prompts go through the chat API with greedy decoding and their outputs are
checked for degenerate text (repeated 4-grams, non-printable characters). Peak RSS is the
replica process's high-water mark after all of it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import httpx

from modelship.loadgen import make_prompts, run_level
from modelship.server.process import ReplicaProcess

GOLDEN_PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "List three colors.",
    "Explain what a computer is in one sentence.",
]
SERVED_NAME = "candidate"


@dataclass
class ServingResult:
    ttft_s: float
    tpot_s: float
    throughput_tok_s: float
    peak_rss_bytes: int | None
    startup_s: float
    failed_requests: int
    golden_outputs: list[str]
    repetition: float
    printable: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def repeated_ngram_share(token_ids: list[int], n: int = 4) -> float:
    """Share of n-grams that already occurred earlier in the same text (0 = no loops)."""
    grams = [tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def printable_share(text: str) -> float:
    if not text:
        return 0.0
    return sum(ch.isprintable() or ch in "\n\t" for ch in text) / len(text)


def measure_serving(
    variant_dir: Path,
    tokenizer,
    serve_args: list[str],
    *,
    log_path: Path,
    latency_requests: int,
    concurrency: int,
    throughput_requests: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int = 7,
) -> ServingResult:
    # Dies with us: a kill -9 of `select` must not leave a replica holding memory and a port.
    replica = ReplicaProcess(
        variant_dir,
        "--served-model-name", SERVED_NAME,
        *serve_args,
        log_path=log_path,
        die_with_parent=True,
    )  # fmt: skip
    try:
        startup = replica.wait_ready()
        prompts = make_prompts(
            tokenizer, latency_requests + throughput_requests, prompt_tokens, seed
        )
        latency = asyncio.run(
            run_level(replica.url, SERVED_NAME, prompts[:latency_requests], 1, output_tokens)
        )
        load = asyncio.run(
            run_level(
                replica.url, SERVED_NAME, prompts[latency_requests:], concurrency, output_tokens
            )
        )
        outputs = _golden(replica.url)
        rss = replica.peak_rss_bytes()
    finally:
        replica.stop()
    ids = [tokenizer(text, add_special_tokens=False).input_ids for text in outputs]
    return ServingResult(
        ttft_s=latency.ttft_p50_ms / 1e3,
        tpot_s=latency.tpot_mean_ms / 1e3,
        throughput_tok_s=load.output_tok_s,
        peak_rss_bytes=rss,
        startup_s=startup,
        failed_requests=latency.failed + load.failed,
        golden_outputs=outputs,
        repetition=max(repeated_ngram_share(t) for t in ids),
        printable=min(printable_share(text) for text in outputs),
    )


def _golden(url: str) -> list[str]:
    async def ask(client: httpx.AsyncClient, prompt: str) -> str:
        body = {
            "model": SERVED_NAME,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 48,
            "temperature": 0,
        }
        response = await client.post(f"{url}/v1/chat/completions", json=body)
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"]

    async def ask_all() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as client:
            return list(await asyncio.gather(*(ask(client, p) for p in GOLDEN_PROMPTS)))

    return asyncio.run(ask_all())
