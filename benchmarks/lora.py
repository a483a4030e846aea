"""Multi-LoRA serving: the base alone, one adapter, a batch mixing four, and adapter churn.

    .venv/bin/python benchmarks/lora.py [--model DIR] [--base DIR] [--rank 16]
        [--concurrency 1 8] [--requests 16] [--max-tokens 48] [--out FILE]

Four PEFT adapters (rank --rank on q/k/v/o/gate/up/down, random A and B, made with PEFT
into a temporary folder from the dense --base: PEFT cannot wrap a compressed checkpoint's
linears) are served over --model (e.g. the int4 release; default: the demo model). Each
scenario runs the same greedy requests (prompts: paragraphs of docs/architecture.md to
continue) closed-loop, with `concurrency` in flight and --requests in all, in one engine,
step by step:
- base: no adapter (the engine has adapters registered, none named);
- one: every request on adapter 0;
- mixed: request i on adapter i mod 4 (every step mixes adapters: one gathered matmul pair
  per adapter and projection);
- churn: as mixed, on an engine with --max-loras 2, so adapters are evicted and reloaded
  from their folders (loads counted).
Reports output tok/s, mean time per output token after the first (TPOT), adapter
loads, and adds that had to wait (every resident adapter busy: 429 from a server);
prints a table, writes JSON with --out. The machine is shared: compare side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from demo import DEFAULT_STORAGE, model_or_demo
from modelship.engine import EngineConfig, LLMEngine, SamplingParams
from modelship.engine.errors import EngineOverloadedError
from texts import architecture_paragraphs

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_ADAPTERS = 4


def make_adapters(model: Path, folder: Path, rank: int) -> list[tuple[str, str]]:
    """NUM_ADAPTERS PEFT adapters of `model` with random A and B (PEFT's own init leaves B
    at zero: an adapter that changes nothing would also cost nothing to skip)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = []
    for i in range(NUM_ADAPTERS):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(
            r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False
        )
        path = folder / f"adapter{i}"
        get_peft_model(base, config).save_pretrained(path)
        adapters.append((f"adapter{i}", str(path)))
    return adapters


def run(
    engine: LLMEngine, requests: list[tuple[str, str | None]], concurrency: int, max_tokens: int
):
    """Closed loop over (prompt, adapter) pairs; per-token arrival times -> tok/s, TPOT."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.block_manager.reset_prefix_cache()
    loads_before = engine.loras.num_loads if engine.loras else 0
    queue = list(enumerate(requests))
    times: dict[str, list[float]] = {}
    in_flight = num_refused = 0
    start = time.perf_counter()
    while queue or engine.has_unfinished():
        while queue and in_flight < concurrency:
            index, (prompt, adapter) = queue[0]
            request_id = f"r{index}-{adapter}-{time.perf_counter_ns()}"
            try:
                engine.add_request(request_id, prompt, params, lora=adapter)
            except EngineOverloadedError:  # every resident adapter busy: retry after a step
                num_refused += 1
                break
            queue.pop(0)
            times[request_id] = []
            in_flight += 1
        for delta in engine.step():
            times[delta.request_id].extend([time.perf_counter()] * len(delta.token_ids))
            in_flight -= delta.finish_reason is not None
    wall = time.perf_counter() - start
    tokens = sum(len(t) for t in times.values())
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return {
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "tok_s": round(tokens / wall, 2),
        "tpot_ms": round(statistics.mean(tpot) * 1000, 2),
        "adapter_loads": (engine.loras.num_loads if engine.loras else 0) - loads_before,
        "refused": num_refused,  # adds that waited: all resident adapters were busy
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the demo model")
    parser.add_argument("--storage", type=Path, default=DEFAULT_STORAGE)
    parser.add_argument("--base", type=Path, help="dense model the adapters are made on")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = model_or_demo(args.model, args.storage)
    prompts = [p[:400] for p in architecture_paragraphs(400)][: args.requests]
    prompts = (prompts * args.requests)[: args.requests]
    with tempfile.TemporaryDirectory() as folder:
        adapters = make_adapters(args.base or Path(model), Path(folder), args.rank)
        names = [name for name, _ in adapters]
        roomy = LLMEngine(model, EngineConfig(loras=tuple(adapters), max_loras=NUM_ADAPTERS))
        tight = LLMEngine(model, EngineConfig(loras=tuple(adapters), max_loras=2))
        scenarios = {
            "base": (roomy, [(p, None) for p in prompts]),
            "one": (roomy, [(p, names[0]) for p in prompts]),
            "mixed": (roomy, [(p, names[i % NUM_ADAPTERS]) for i, p in enumerate(prompts)]),
            "churn": (tight, [(p, names[i % NUM_ADAPTERS]) for i, p in enumerate(prompts)]),
        }
        run(roomy, [(prompts[0], names[0]), (prompts[0], None)], 2, 4)  # warm-up
        results = []
        print(f"{'scenario':<9}{'c':>3}{'tok/s':>9}{'TPOT ms':>9}{'loads':>7}{'waited':>8}")
        for concurrency in args.concurrency:
            for name, (engine, requests) in scenarios.items():
                result = run(engine, requests, concurrency, args.max_tokens)
                results.append({"scenario": name, "concurrency": concurrency, **result})
                print(f"{name:<9}{concurrency:>3}{result['tok_s']:>9.1f}"
                      f"{result['tpot_ms']:>9.1f}{result['adapter_loads']:>7}"
                      f"{result['refused']:>8}")  # fmt: skip
    report = {"model": str(model), "rank": args.rank, "max_tokens": args.max_tokens,
              "requests": args.requests, "results": results}  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
