"""The int8 and fp8 KV caches against fp32 at an equal memory budget: capacity, speed, quality.

    .venv/bin/python benchmarks/kv_cache.py [--model DIR] [--kv-cache-memory-mb 64]
        [--concurrency 16] [--max-tokens 64] [--passages 6] [--out FILE]

For each KV cache dtype (float32, int8, fp8 e4m3), one engine with the same `kv_cache_memory_bytes`:
- blocks: the pool's size, and how many 256-token sequences fit in it at once;
- decode tok/s at c=16: 16 greedy requests (64 output tokens each, ignore_eos) added
  together; tokens after every request has its first one, over the time they took (the
  prefills are left out). Preemptions are counted: a pool too small for the batch
  recomputes sequences, which is part of what a bigger pool buys;
- quality: paragraphs of docs/architecture.md scored teacher-forced with `engine.score()`;
  each cache's perplexity, and (int8, fp8 against fp32) the share of positions whose top-1
  next token agrees and the mean |log p(actual next token)| difference.
The fp8 cache runs on SDPA attention (the CPU kernel has no fp8 path), fp32 and int8 on the
CPU kernel where it builds: the tok/s column compares the attention paths too.
Prints a table, writes JSON with --out. The machine is shared: compare runs side by side.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from demo import DEFAULT_STORAGE, model_or_demo
from modelship.engine import EngineConfig, LLMEngine, SamplingParams
from texts import architecture_paragraphs

DTYPES = ("float32", "int8", "fp8")
SEQUENCE_TOKENS = 256  # the sequence length "blocks" is counted in
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a paged KV cache works.",
    "What are good habits for studying?",
    "Describe a city at night.",
]


def passages(count: int) -> list[str]:
    return architecture_paragraphs(600)[:count]


def decode_speed(engine: LLMEngine, concurrency: int, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.block_manager.reset_prefix_cache()
    preemptions = engine.stats().num_preemptions
    counts: dict[str, int] = {}
    for i in range(concurrency):
        engine.add_request(f"d{i}", PROMPTS[i % len(PROMPTS)], params)
        counts[f"d{i}"] = 0
    start = time.perf_counter()
    decode_start = decode_tokens = None
    while engine.has_unfinished():
        for delta in engine.step():
            counts[delta.request_id] += len(delta.token_ids)
        if decode_start is None and min(counts.values()) > 0:
            decode_start, decode_tokens = time.perf_counter(), sum(counts.values())
    end = time.perf_counter()
    total = sum(counts.values())
    assert decode_start is not None and decode_tokens is not None
    return {
        "output_tokens": total,
        "wall_s": round(end - start, 2),
        "decode_tok_s": round((total - decode_tokens) / (end - decode_start), 1),
        "preemptions": engine.stats().num_preemptions - preemptions,
    }


def score(engine: LLMEngine, texts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per passage: (top-1 next token [len - 1], log p(actual next token) [len - 1])."""
    sequences = [engine.tokenizer(text).input_ids[:512] for text in texts]
    results = []
    for ids, logprobs in zip(sequences, engine.score(sequences), strict=True):
        targets = torch.tensor(ids[1:]).unsqueeze(1)
        results.append((logprobs.argmax(-1), logprobs.gather(1, targets).squeeze(1)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the demo model")
    parser.add_argument("--storage", type=Path, default=DEFAULT_STORAGE)
    parser.add_argument("--kv-cache-memory-mb", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = model_or_demo(args.model, args.storage)
    texts = passages(args.passages)
    rows, scores = {}, {}
    for dtype in DTYPES:
        config = EngineConfig(
            kv_cache_dtype=dtype, kv_cache_memory_bytes=args.kv_cache_memory_mb * 1024**2
        )
        engine = LLMEngine(model, config)
        num_blocks = engine.block_manager.num_blocks
        decode_speed(engine, 2, 4)  # warm-up
        rows[dtype] = {
            "attention": engine.runner.attention_backend,
            "blocks": num_blocks,
            "max_sequences": num_blocks // -(-SEQUENCE_TOKENS // config.block_size),
            **decode_speed(engine, args.concurrency, args.max_tokens),
        }
        scores[dtype] = score(engine, texts)
        del engine
    for dtype in DTYPES:
        logprobs = torch.cat([lp for _, lp in scores[dtype]])
        rows[dtype]["perplexity"] = round(logprobs.mean().neg().exp().item(), 3)
        if dtype == "float32":
            continue
        agree, diffs = [], []
        for (top_ref, lp_ref), (top, lp) in zip(scores["float32"], scores[dtype], strict=True):
            agree.append((top == top_ref).float())
            diffs.append((lp - lp_ref).abs())
        agree_all, diffs_all = torch.cat(agree), torch.cat(diffs)
        rows[dtype]["top1_agreement"] = round(agree_all.mean().item(), 4)
        rows[dtype]["mean_abs_logprob_diff"] = round(diffs_all.mean().item(), 5)
        rows[dtype]["max_abs_logprob_diff"] = round(diffs_all.max().item(), 4)

    print(
        f"KV cache {args.kv_cache_memory_mb} MiB, c={args.concurrency} x {args.max_tokens} "
        f"tokens, {len(texts)} passages ({sum(len(lp) for _, lp in scores['float32'])} "
        "scored tokens)"
    )
    print(
        f"{'kv dtype':<9}{'attention':>10}{'blocks':>8}{'seqs@256':>10}{'tok/s':>8}"
        f"{'preempt':>9}{'ppl':>8}{'top-1 agree':>13}{'mean |dlogp|':>14}"
    )
    for dtype, row in rows.items():
        quality = (
            f"{row['top1_agreement']:>13.4f}{row['mean_abs_logprob_diff']:>14.5f}"
            if dtype != "float32"
            else f"{'(reference)':>13}{'':>14}"
        )
        print(
            f"{dtype:<9}{row['attention']:>10}{row['blocks']:>8}{row['max_sequences']:>10}"
            f"{row['decode_tok_s']:>8.1f}{row['preemptions']:>9}{row['perplexity']:>8.3f}{quality}"
        )
    for dtype in DTYPES[1:]:
        ratio = rows[dtype]["blocks"] / rows["float32"]["blocks"]
        speed = rows[dtype]["decode_tok_s"] / rows["float32"]["decode_tok_s"]
        print(f"{dtype} / fp32: {ratio:.2f}x blocks, {speed:.2f}x decode tok/s")
    if args.out:
        args.out.write_text(json.dumps({"model": str(model), "kv_cache_memory_mb":
                                        args.kv_cache_memory_mb, "concurrency": args.concurrency,
                                        "max_tokens": args.max_tokens, "results": rows},
                                       indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
