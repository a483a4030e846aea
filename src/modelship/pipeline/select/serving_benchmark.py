"""Serving behaviour of the variants: one real `modelship serve` replica each, measured in
interleaved rounds.

All candidates' replicas run at once and are measured one at a time, round after round
(A B C, B C A, C A B, ...), so a slow minute on a shared machine lands on every variant
rather than on whichever was measured then. Each round gives every variant the same fresh
prompts: a latency trial alone (concurrency 1: TTFT p50 and time per output token) and a
throughput trial under `concurrency` streams, both with the shared load generator
(`modelship.loadgen`). Rounds go on until every variant's metrics have 95% intervals
within `ci_target` of their means (after `min_rounds`), or `max_rounds` or the time budget
ends them. Then the golden prompts go through the chat API with greedy decoding and their
outputs are checked for degenerate text: per prompt, how many of its 4-grams repeat an
earlier one and how many of its characters are printable (`GoldenCheck`), pooled over all
prompts into the shares the gates read (their intervals come from `intervals.py`); peak
RSS is each replica process's high-water mark after all of it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from modelship.loadgen import make_prompts, run_level
from modelship.pipeline.select.stats import Estimate
from modelship.release import golden
from modelship.server.process import ReplicaProcess

SERVED_NAME = "candidate"
ROUND_METRICS = ("ttft_s", "tpot_s", "throughput_tok_s")


@dataclass(frozen=True)
class Workload:
    """What one round sends to each variant, and when rounds stop."""

    latency_requests: int
    concurrency: int
    throughput_requests: int
    prompt_tokens: int
    output_tokens: int
    min_rounds: int = 3
    max_rounds: int = 10
    ci_target: float = 0.05  # stop once every 95% half-width is within this share of its mean
    budget_s: float = 300.0  # past this many seconds of measuring, no round beyond min_rounds
    seed: int = 7


@dataclass
class ServingResult:
    ttft_s: float  # means over rounds
    tpot_s: float
    throughput_tok_s: float
    ci: dict[str, float]  # metric -> 95% half-width of the mean
    samples: dict[str, list[float]]  # metric -> one value per round
    rounds: int
    stopped: str  # "converged", "max_rounds" or "time_budget"
    prompt_tokens: int  # of each request (TTFT is for a prompt this long)
    peak_rss_bytes: int | None
    startup_s: float
    failed_requests: int
    golden_outputs: list[str]
    golden: list[dict]  # `golden.GoldenAnswer`s: the reference a release's replicas are probed with
    golden_checks: list[dict]  # one `GoldenCheck` per golden prompt, in the order of the outputs
    repetition: float  # repeated 4-grams / all 4-grams, over all golden outputs together
    printable: float  # printable characters / all characters, over all golden outputs together

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class GoldenCheck:
    """One golden output's degeneration counts: of its n-grams (token 4-grams), how many
    already occurred earlier in the same output (a loop repeats them); of its characters,
    how many are printable (newline and tab count as printable)."""

    repeated_ngrams: int
    ngrams: int
    printable_chars: int
    chars: int

    @classmethod
    def of(cls, text: str, token_ids: list[int], n: int = 4) -> GoldenCheck:
        grams = [tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1)]
        printable = sum(ch.isprintable() or ch in "\n\t" for ch in text)
        return cls(len(grams) - len(set(grams)), len(grams), printable, len(text))


@dataclass
class _Candidate:
    name: str
    replica: ReplicaProcess
    startup_s: float = 0.0
    samples: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in ROUND_METRICS})
    failed_requests: int = 0
    error: str | None = None

    def estimates(self) -> dict[str, Estimate]:
        return {m: Estimate.of(v) for m, v in self.samples.items() if v}


def measure_serving(
    variants: dict[str, Path],
    tokenizer,
    serve_args: Callable[[str], list[str]],
    workload: Workload,
    *,
    log_dir: Path,
    log: Callable[[str], None] = print,
) -> dict[str, ServingResult | str]:
    """Each variant's serving numbers, or the reason it could not be measured."""
    candidates: list[_Candidate] = []
    outcomes: dict[str, ServingResult | str] = {}
    try:
        for name, folder in variants.items():
            try:  # dies with us: a kill -9 of `select` must not leave replicas holding memory
                replica = ReplicaProcess(
                    folder,
                    "--served-model-name", SERVED_NAME,
                    *serve_args(name),
                    log_path=log_dir / f"{name}-serve.log",
                    die_with_parent=True,
                )  # fmt: skip
            except Exception as exc:
                outcomes[name] = _reason(exc)
                continue
            candidates.append(_Candidate(name, replica))
        for candidate in candidates:
            try:
                candidate.startup_s = candidate.replica.wait_ready()
            except Exception as exc:
                candidate.error = _reason(exc)
                log(f"{candidate.name}: {candidate.error}")
        rounds, stopped = _run_rounds(candidates, tokenizer, workload, log)
        for candidate in candidates:
            if candidate.error is None:
                try:
                    outcomes[candidate.name] = _finish(
                        candidate, tokenizer, rounds, stopped, workload.prompt_tokens
                    )
                except Exception as exc:
                    candidate.error = _reason(exc)
            if candidate.error is not None:
                outcomes[candidate.name] = candidate.error
    finally:
        for candidate in candidates:
            candidate.replica.stop()
    return outcomes


def _run_rounds(candidates, tokenizer, workload: Workload, log) -> tuple[int, str]:
    started = time.monotonic()
    per_round = workload.latency_requests + workload.throughput_requests
    rounds = 0
    while True:
        live = [c for c in candidates if c.error is None]
        if not live:
            return rounds, "no variant left"
        if rounds >= workload.min_rounds and _converged(live, workload.ci_target):
            return rounds, "converged"
        if rounds >= workload.max_rounds:
            return rounds, "max_rounds"
        if rounds >= workload.min_rounds and time.monotonic() - started > workload.budget_s:
            return rounds, "time_budget"
        prompts = make_prompts(tokenizer, per_round, workload.prompt_tokens, workload.seed + rounds)
        shift = rounds % len(live)
        for candidate in live[shift:] + live[:shift]:  # rotated: no variant always goes first
            try:
                _one_round(candidate, prompts, workload)
            except Exception as exc:  # the replica died or answered garbage
                candidate.error = _reason(exc)
                log(f"{candidate.name}: {candidate.error}")
        rounds += 1
        summary = ", ".join(
            f"{c.name} {_brief(c)}" for c in candidates if c.error is None and c.samples["ttft_s"]
        )
        log(f"serving round {rounds}: {summary}")


def _one_round(candidate: _Candidate, prompts: list[str], workload: Workload) -> None:
    url = candidate.replica.url
    if candidate.replica.has_exited():
        raise RuntimeError(f"the replica exited: {candidate.replica.log_tail(5)}")
    split = workload.latency_requests
    latency = asyncio.run(run_level(url, SERVED_NAME, prompts[:split], 1, workload.output_tokens))
    load = asyncio.run(
        run_level(url, SERVED_NAME, prompts[split:], workload.concurrency, workload.output_tokens)
    )
    candidate.failed_requests += latency.failed + load.failed
    if latency.requests == 0 or load.requests == 0:
        raise RuntimeError("every request of a round failed")
    values = {
        "ttft_s": latency.ttft_p50_ms / 1e3,
        "tpot_s": latency.tpot_mean_ms / 1e3,
        "throughput_tok_s": load.output_tok_s,
    }
    for metric, value in values.items():
        if not math.isnan(value):
            candidate.samples[metric].append(value)


def _converged(candidates: list[_Candidate], target: float) -> bool:
    return all(
        estimate.relative_half_width <= target
        for c in candidates
        for estimate in c.estimates().values()
    )


def _brief(candidate: _Candidate) -> str:
    e = candidate.estimates()
    return (
        f"ttft {e['ttft_s'].mean * 1e3:.1f} ms, {e['throughput_tok_s'].mean:.1f} tok/s"
        if "throughput_tok_s" in e
        else ""
    )


def _finish(
    candidate: _Candidate, tokenizer, rounds: int, stopped: str, prompt_tokens: int
) -> ServingResult:
    estimates = candidate.estimates()
    missing = [m for m in ROUND_METRICS if m not in estimates]
    if missing:
        raise RuntimeError(f"no round measured {', '.join(missing)}")
    answers = asyncio.run(_golden(candidate.replica.url))
    outputs = [answer.text for answer in answers]
    checks = [
        GoldenCheck.of(text, tokenizer(text, add_special_tokens=False).input_ids)
        for text in outputs
    ]
    ngrams, chars = sum(c.ngrams for c in checks), sum(c.chars for c in checks)
    return ServingResult(
        ttft_s=estimates["ttft_s"].mean,
        tpot_s=estimates["tpot_s"].mean,
        throughput_tok_s=estimates["throughput_tok_s"].mean,
        ci={m: e.half_width for m, e in estimates.items()},
        samples=candidate.samples,
        rounds=rounds,
        stopped=stopped,
        prompt_tokens=prompt_tokens,
        peak_rss_bytes=candidate.replica.peak_rss_bytes(),
        startup_s=candidate.startup_s,
        failed_requests=candidate.failed_requests,
        golden_outputs=outputs,
        golden=[asdict(answer) for answer in answers],
        golden_checks=[asdict(check) for check in checks],
        repetition=sum(c.repeated_ngrams for c in checks) / ngrams if ngrams else 0.0,
        printable=sum(c.printable_chars for c in checks) / chars if chars else 0.0,
    )


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]


async def _golden(url: str) -> list[golden.GoldenAnswer]:
    async with httpx.AsyncClient() as client:
        return await golden.ask_all(client, url, SERVED_NAME)
