"""A fixed streaming workload against any OpenAI endpoint: TTFT, ITL and output tok/s.

`select` measures every variant with it and `benchmarks/serving.py` measures peers with
it, so the numbers mean the same thing everywhere. Requests are streaming
`/v1/completions` with EOS ignored, so each produces exactly `max_tokens` tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import httpx


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    requests: int
    failed: int
    seconds: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_mean_ms: float  # (e2e - ttft) / (tokens - 1), averaged over requests
    mean_output_tokens: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def make_prompts(tokenizer, count: int, prompt_tokens: int, seed: int) -> list[str]:
    """`count` distinct prompts of `prompt_tokens` tokens cut from the held-out corpus, so
    no server can answer one from another's prompt cache."""
    from modelship.pipeline.calibration import held_out_texts

    rng = random.Random(seed)
    corpus = tokenizer("\n".join(held_out_texts())).input_ids
    prompts = []
    for _ in range(count):
        start = rng.randrange(0, len(corpus) - prompt_tokens)
        prompts.append(tokenizer.decode(corpus[start : start + prompt_tokens]))
    return prompts


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    extra: dict | None = None,
) -> dict:
    """`extra`: more body fields (a `response_format`, say)."""
    body = {
        **(extra or {}),
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise httpx.HTTPStatusError(
                f"{response.status_code}: {response.text[:200]}",
                request=response.request,
                response=response,
            )
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens") or len(arrivals)
    ttft = arrivals[0] - start if arrivals else float("nan")
    return {
        "ttft": ttft,
        "itl": [b - a for a, b in itertools.pairwise(arrivals)],
        "tpot": (end - start - ttft) / (tokens - 1) if tokens > 1 else float("nan"),
        "tokens": tokens,
    }


async def run_level(
    url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    extra: dict | None = None,
) -> LevelResult:
    """Send every prompt, `concurrency` at a time; failed requests are counted, not hidden."""
    queue = list(prompts)
    results: list[dict] = []
    failed = 0
    # A new connection per request, for every server alike: llama-server (cpp-httplib)
    # drops a kept-alive connection after a few requests without saying so.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            nonlocal failed
            while queue:
                prompt = queue.pop()
                try:
                    results.append(await one_request(client, url, model, prompt, max_tokens, extra))
                except httpx.HTTPError:
                    failed += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results)
    itls = sorted(x for r in results for x in r["itl"])
    tpots = [r["tpot"] for r in results if r["tpot"] == r["tpot"]]
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        failed=failed,
        seconds=seconds,
        output_tok_s=sum(r["tokens"] for r in results) / seconds,
        ttft_p50_ms=percentile(ttfts, 50) * 1e3,
        ttft_p99_ms=percentile(ttfts, 99) * 1e3,
        itl_p50_ms=percentile(itls, 50) * 1e3,
        itl_p99_ms=percentile(itls, 99) * 1e3,
        tpot_mean_ms=statistics.mean(tpots) * 1e3 if tpots else float("nan"),
        mean_output_tokens=statistics.mean(r["tokens"] for r in results) if results else 0.0,
    )


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted `values` (nan when empty)."""
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]
