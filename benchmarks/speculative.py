"""Speculative decoding (prompt lookup, and a draft model) on and off, on two workloads, at
two concurrencies.

    .venv/bin/python benchmarks/speculative.py [--model DIR] [--num-tokens 4]
        [--concurrency 1 8] [--requests 8] [--max-tokens 128] [--draft-model DIR]
        [--out FILE]

With --draft-model (e.g. one made by benchmarks/make_draft.py: the demo model's first
layers), a second engine speculates with it and its rows ("draft") join prompt lookup's
("ngram") against the same plain runs ("off").

Workloads, each through the demo model's chat template:
- grounded: "repeat this text" over paragraphs of docs/architecture.md (the answer quotes
  its input: prompt lookup's best case);
- open: open-ended questions (little to look up: drafts are mostly rejected, and
  sequences whose drafts keep failing stop drafting).
Each (workload, concurrency) runs the same greedy requests with speculation off and on
(closed loop: `concurrency` requests in flight, `--requests` in all) in one engine, step by
step, timing every token's arrival. Reports output tok/s, mean time per output token after
the first (TPOT, "ITL") and the draft acceptance rate; the speed-up is on/off tok/s. Prints
a table, writes JSON with --out. The machine is shared: compare runs side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from demo import DEFAULT_STORAGE, model_or_demo
from modelship.engine import EngineConfig, LLMEngine, SamplingParams
from modelship.engine.speculative import SpeculativeConfig
from texts import architecture_paragraphs

OPEN_QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good habits for staying focused while studying?",
    "Describe your ideal weekend in a few sentences.",
    "Explain why the sky looks blue to someone who has never studied physics.",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "What would you pack for a week-long hiking trip, and why?",
    "Write a poem about autumn leaves.",
    "How do bees make honey?",
]


def grounded_prompts(count: int) -> list[str]:
    paragraphs = architecture_paragraphs(300)
    ask = "Repeat the following text exactly, word for word."
    return [f"{ask}\n\n{paragraphs[i % len(paragraphs)][:600]}" for i in range(count)]


def run(
    engine: LLMEngine, prompts: list[str], concurrency: int, max_tokens: int, speculative: bool
):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, speculative=speculative)
    engine.block_manager.reset_prefix_cache()  # each run computes its prompts
    pending = list(enumerate(prompts))
    arrivals: dict[str, list[float]] = {}
    stats_before = engine.stats()
    start = time.perf_counter()
    in_flight = 0
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            index, prompt = pending.pop(0)
            text = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            ids = engine.tokenizer(text, add_special_tokens=False).input_ids
            engine.add_request(f"r{index}-{speculative}", list(ids), params)
            arrivals[f"r{index}-{speculative}"] = []
            in_flight += 1
        for delta in engine.step():
            now = time.perf_counter()
            arrivals[delta.request_id].extend([now] * len(delta.token_ids))
            if delta.finish_reason is not None:
                in_flight -= 1
    wall = time.perf_counter() - start
    stats = engine.stats()
    tokens = sum(len(times) for times in arrivals.values())
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in arrivals.values() if len(t) > 1]
    drafted = stats.spec_num_draft_tokens - stats_before.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - stats_before.spec_num_accepted_tokens
    return {
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "tok_s": round(tokens / wall, 2),
        "tpot_ms": round(statistics.mean(tpot) * 1000, 2) if tpot else None,
        "draft_tokens": drafted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the demo model")
    parser.add_argument("--storage", type=Path, default=DEFAULT_STORAGE)
    parser.add_argument("--num-tokens", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=SpeculativeConfig(1).max_batch_size,
        help="no drafts in steps with more running sequences (the serve default)",
    )
    parser.add_argument("--draft-model", type=Path, help="also speculate with this draft model")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = model_or_demo(args.model, args.storage)
    engines = {}
    for method in ("ngram", "draft") if args.draft_model else ("ngram",):
        speculative = SpeculativeConfig(
            num_tokens=args.num_tokens,
            max_batch_size=max(args.concurrency),  # as before: speculate at every c
            method=method,
            draft_model=str(args.draft_model) if method == "draft" else None,
        )
        engines[method] = LLMEngine(model, EngineConfig(speculative=speculative))
    engine = engines["ngram"]
    workloads = {
        "grounded": grounded_prompts(args.requests),
        "open": [OPEN_QUESTIONS[i % len(OPEN_QUESTIONS)] for i in range(args.requests)],
    }
    for each in engines.values():
        run(each, workloads["open"][:1], 1, 8, True)  # warm-up
    results = []
    header = (
        f"{'workload':<9}{'c':>3}{'spec':>6}{'tok/s':>9}{'TPOT ms':>9}{'accept':>8}{'speed-up':>10}"
    )
    print(header)
    for name, prompts in workloads.items():
        for concurrency in args.concurrency:
            off = run(engine, prompts, concurrency, args.max_tokens, False)
            result = {"workload": name, "concurrency": concurrency, "off": off}
            rows = [("off", off)]
            for method, each in engines.items():
                result[method] = run(each, prompts, concurrency, args.max_tokens, True)
                result[f"{method}_speedup"] = round(result[method]["tok_s"] / off["tok_s"], 2)
                rows.append((method, result[method]))
            for label, row in rows:
                rate = row["acceptance_rate"]
                speedup = result.get(f"{label}_speedup")
                print(
                    f"{name:<9}{concurrency:>3}{label:>6}{row['tok_s']:>9.1f}{row['tpot_ms']:>9.1f}"
                    f"{'' if rate is None else f'{rate:.2f}':>8}"
                    f"{'' if speedup is None else f'{speedup:.2f}x':>10}"
                )
            results.append(result)
    if args.out:
        args.out.write_text(json.dumps({"model": str(model), "num_tokens": args.num_tokens,
                                        "max_batch_size": args.max_batch_size,
                                        "draft_model": args.draft_model and str(args.draft_model),
                                        "results": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
