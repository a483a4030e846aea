"""Structured outputs' cost: output tok/s with and without a JSON schema, mask time per
step, grammar compile time and cache hit, on the demo model.

    .venv/bin/python benchmarks/structured.py [--storage ./modelship-data] [--levels 1,8]

Serving: `modelship serve` on the demo model (base variant), the loadgen workload
(streaming /v1/completions, 128-token prompts, exactly 64 output tokens, greedy) at each
concurrency, once free and once with `response_format` json_schema. The schema asks for at
least 8 {name, age} objects, so no constrained answer can end before 64 tokens: both runs
produce the same number of tokens. Every run has its own prompts (no prefix-cache hits
from an earlier run). The first constrained request with a new schema pays its
compile; its TTFT against a second request with the same schema is the server-side view.

In process (the engine's own `GrammarCompiler` and `BitmaskFiller` on the demo tokenizer):
the llguidance tokenizer build (once per engine), a schema's first compile, a cache hit,
and the time to fill the masks of one step for 1 and 8 sequences, along a valid answer.
Prints a table and writes JSON (default benchmarks/results/structured.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from modelship.engine import GrammarSpec
from modelship.engine.structured import BitmaskFiller, GrammarCompiler
from modelship.engine.tokenizer import load_tokenizer
from modelship.loadgen import make_prompts, one_request, run_level
from modelship.model.config import ModelConfig
from modelship.model.loader import read_generation_eos
from modelship.pipeline.acquire import acquire
from modelship.storage import Storage
from serving import start_server, stop_server

SCHEMA = {
    "type": "array",
    "minItems": 8,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
}
ANSWER = json.dumps([{"name": f"Person number {i}", "age": 20 + i} for i in range(10)])


def json_schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "people", "schema": schema}}}  # fmt: skip


def in_process(model_dir: Path, repeats: int = 200) -> dict:
    tokenizer = load_tokenizer(model_dir)
    config = ModelConfig.from_dir(model_dir)
    eos = set(config.eos_token_ids) | read_generation_eos(model_dir)
    compiler = GrammarCompiler(tokenizer, config.vocab_size, eos)
    spec = GrammarSpec.json_schema(SCHEMA)
    start = time.perf_counter()
    compiler.lltokenizer()
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    compiler.matcher(spec)
    compile_ms = (time.perf_counter() - start) * 1e3
    hits = []
    for _ in range(repeats):
        start = time.perf_counter()
        compiler.matcher(spec)
        hits.append(time.perf_counter() - start)
    filler = BitmaskFiller()
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    result = {"vocab_size": config.vocab_size, "tokenizer_build_ms": tokenizer_ms,
              "first_compile_ms": compile_ms,
              "cache_hit_us": statistics.median(hits) * 1e6}  # fmt: skip
    for batch in (1, 8):
        matchers = [compiler.matcher(spec) for _ in range(batch)]
        steps = []
        for token_id in answer:
            start = time.perf_counter()
            filler.fill([(m, row) for row, m in enumerate(matchers)], batch, config.vocab_size)
            steps.append(time.perf_counter() - start)
            for matcher in matchers:
                assert matcher.accept(token_id), "the sample answer must match the schema"
        result[f"first_mask_ms_b{batch}"] = steps[0] * 1e3  # lexer states built lazily
        steps = steps[1:]
        result[f"mask_step_us_b{batch}_p50"] = statistics.median(steps) * 1e6
        result[f"mask_step_us_b{batch}_p99"] = sorted(steps)[int(0.99 * (len(steps) - 1))] * 1e6
    return result


async def first_and_cached_ttft(url: str, model: str, prompt: str) -> dict:
    """TTFT of a request with a schema the server has never seen, then the same again."""
    schema = {**SCHEMA, "description": f"fresh {time.time_ns()}"}  # a new cache key
    async with httpx.AsyncClient(timeout=600) as client:
        first = await one_request(client, url, model, prompt, 8, json_schema_format(schema))
        cached = await one_request(client, url, model, prompt, 8, json_schema_format(schema))
        free = await one_request(client, url, model, prompt, 8)
    return {"ttft_first_schema_ms": first["ttft"] * 1e3,
            "ttft_cached_schema_ms": cached["ttft"] * 1e3,
            "ttft_free_ms": free["ttft"] * 1e3}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--storage", default="./modelship-data")
    parser.add_argument("--levels", default="1,8")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8111)
    parser.add_argument("--seed", type=int, default=101)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/structured.json"))
    args = parser.parse_args()
    model_dir = acquire("demo", Storage(args.storage)).path
    report: dict = {"in_process": in_process(model_dir)}
    print("in process (demo tokenizer):")
    for key, value in report["in_process"].items():
        print(f"  {key:<24}{value:>12.1f}")

    levels = [int(x) for x in args.levels.split(",")]
    tokenizer = load_tokenizer(model_dir)
    # distinct prompts for every run: none may hit the prefix cache another run filled
    per_run = 2 * max(levels) + 8
    prompts = make_prompts(tokenizer, 2 * len(levels) * per_run + 1, 128, args.seed)
    runs = iter(range(0, 2 * len(levels) * per_run, per_run))
    url, model = f"http://127.0.0.1:{args.port}", "smollm2"
    command = [sys.executable, "-m", "modelship", "serve", str(model_dir), "--port",
               str(args.port), "--served-model-name", model]  # fmt: skip
    process = start_server(command, url)
    rows = []
    try:
        report["ttft"] = asyncio.run(first_and_cached_ttft(url, model, prompts[-1]))
        print(f"{'workload':<14}{'conc':>5}{'tok/s':>10}{'ITL p50':>10}{'TTFT p50':>10}")
        for level in levels:
            count = max(8, 2 * level)
            for name, extra in (("free", None), ("json_schema", json_schema_format(SCHEMA))):
                first = next(runs)
                batch = prompts[first : first + count]
                result = asyncio.run(run_level(url, model, batch, level, args.output_tokens, extra))
                row = {"workload": name, **result.to_dict()}
                tok_s, itl, ttft = row["output_tok_s"], row["itl_p50_ms"], row["ttft_p50_ms"]
                print(f"{name:<14}{level:>5}{tok_s:>10.1f}{itl:>10.1f}{ttft:>10.0f}", flush=True)
                rows.append(row)
    finally:
        stop_server(process)
    report["serving"] = rows
    for level in levels:
        free, constrained = (next(r for r in rows if r["workload"] == w and
                                  r["concurrency"] == level)
                             for w in ("free", "json_schema"))  # fmt: skip
        overhead = 1 - constrained["output_tok_s"] / free["output_tok_s"]
        report[f"overhead_c{level}"] = overhead
        print(f"c={level}: json_schema costs {overhead:.1%} of output tok/s")
    for key, value in report["ttft"].items():
        print(f"  {key:<24}{value:>12.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
