"""Engine throughput on the demo model: modelship (bf16, int4) vs transformers `generate`.

    .venv/bin/python benchmarks/engine_throughput.py [--int4 DIR] [--out FILE]
    .venv/bin/python benchmarks/engine_throughput.py --model moe  (`moe_throughput.py`)

Workload: 64 requests, prompt lengths 32-512 tokens and max_tokens 16-256 (seeded), every
request generating exactly its max_tokens (EOS ignored), so all systems do the same work.
Also measured: batch-1 decode speed of each engine variant, and the TTFT of a request that
shares a 1,024-token prefix with the previous one (prefix cache hit) vs the first (cold).
Prints a table and writes JSON (default benchmarks/results/engine_throughput.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from pathlib import Path

import torch

from modelship.engine import LLM, SamplingParams
from modelship.pipeline.acquire import DEMO_SLUG, acquire
from modelship.pipeline.calibration import held_out_texts
from modelship.storage import Storage


def make_workload(tokenizer, num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    corpus = tokenizer("\n".join(held_out_texts())).input_ids
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(32, 512)
        start = rng.randint(0, len(corpus) - prompt_len - 1)
        requests.append((corpus[start : start + prompt_len], rng.randint(16, 256)))
    return requests


def bench_engine(llm: LLM, workload) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in workload]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == sum(m for _, m in workload)
    return {"seconds": seconds, "output_tokens": generated, "output_tok_s": generated / seconds}


def bench_decode(llm: LLM, prompt: list[int], num_tokens: int = 128) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    engine.add_request("decode", prompt, params)
    times = []
    while engine.has_unfinished():
        engine.step()
        times.append(time.perf_counter())
    steps = [b - a for a, b in itertools.pairwise(times[1:])]  # after the prefill step
    step_s = sorted(steps)[len(steps) // 2]
    return {"median_step_ms": step_s * 1e3, "decode_tok_s": 1 / step_s}


def bench_prefix(llm: LLM, corpus: list[int]) -> dict:
    engine = llm.engine
    prefix = corpus[:1024]
    ttfts = []
    for i, suffix in enumerate((corpus[2000:2016], corpus[3000:3016])):
        params = SamplingParams(temperature=0, max_tokens=1)
        start = time.perf_counter()
        engine.add_request(f"prefix-{i}", prefix + suffix, params)
        while engine.has_unfinished():
            engine.step()
        ttfts.append(time.perf_counter() - start)
    return {"ttft_cold_s": ttfts[0], "ttft_hit_s": ttfts[1], "speedup": ttfts[0] / ttfts[1]}


def bench_transformers(model_dir: Path, workload, batch_size: int, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        max_new = max(m for _, m in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
            )
        useful += sum(m for _, m in batch)  # what the requests asked for; padding is waste
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": useful, "output_tok_s": useful / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        choices=["demo", "moe"],
        default="demo",
        help="demo: the workload below; moe: a random OLMoE-shaped MoE vs a dense model with "
        "the same active parameters (moe_throughput.py)",
    )
    parser.add_argument("--moe-layers", type=int, default=2)
    parser.add_argument("--moe-scale", type=int, default=2, help="OLMoE's widths divided by")
    parser.add_argument("--new-tokens", type=int, default=32, help="--model moe: per request")
    parser.add_argument("--storage", default="./modelship-data")
    parser.add_argument("--int4", type=Path, help="a GPTQ/AWQ compressed-tensors folder")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--one-by-one", type=int, default=8, help="requests for HF one by one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/engine_throughput.json")
    )
    args = parser.parse_args()
    if args.model == "moe":
        moe_main(args)
        return

    base = acquire("demo", Storage(args.storage)).path
    if args.int4 is None:
        gptq = Storage(args.storage).variant_dir(DEMO_SLUG, "gptq")
        args.int4 = gptq if gptq.is_dir() else None
    results: dict = {"model": str(base), "threads": torch.get_num_threads()}

    variants = [("modelship bf16", base)] + ([("modelship int4", args.int4)] if args.int4 else [])
    workload = None
    for name, path in variants:
        llm = LLM(path)
        if workload is None:
            workload = make_workload(llm.tokenizer, args.num_requests, args.seed)
            corpus = llm.tokenizer("\n".join(held_out_texts())).input_ids
        print(f"{name}: {args.num_requests} requests ...", flush=True)
        results[name] = bench_engine(llm, workload)
        results[name]["batch1"] = bench_decode(llm, workload[0][0])
        results[name]["prefix"] = bench_prefix(llm, corpus)
        del llm

    print("transformers: static batches of 16, then one by one ...", flush=True)
    results["transformers static x16"] = bench_transformers(base, workload, 16, torch.float32)
    subset = workload[: args.one_by_one]
    results["transformers one-by-one"] = bench_transformers(base, subset, 1, torch.float32)
    results["transformers one-by-one"]["requests"] = len(subset)

    print(
        f"\n{'system':<28}{'output tok/s':>14}{'seconds':>10}"
        f"{'batch-1 tok/s':>15}{'prefix TTFT x':>15}"
    )
    for name, row in results.items():
        if not isinstance(row, dict):
            continue
        batch1 = row.get("batch1", {}).get("decode_tok_s")
        prefix = row.get("prefix", {}).get("speedup")
        print(
            f"{name:<28}{row['output_tok_s']:>14.1f}{row['seconds']:>10.1f}"
            f"{batch1 if batch1 is not None else float('nan'):>15.1f}"
            f"{prefix if prefix is not None else float('nan'):>15.1f}"
        )
    static = results["transformers static x16"]["output_tok_s"]
    for name, _ in variants:
        print(f"{name}: {results[name]['output_tok_s'] / static:.2f}x transformers static x16")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


def moe_main(args: argparse.Namespace) -> None:
    import tempfile

    import moe_throughput

    batches = [1, 16]
    with tempfile.TemporaryDirectory() as folder:
        results = moe_throughput.run(
            Path(folder), args.moe_layers, args.moe_scale, args.new_tokens, batches
        )
    results["threads"] = torch.get_num_threads()
    moe_throughput.print_table(results, batches)
    out = args.out.with_name("engine_throughput_moe.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
