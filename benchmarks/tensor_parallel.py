"""Decode tok/s at tensor-parallel size 1 and 2, and the share of step time in all-reduces.

    .venv/bin/python benchmarks/tensor_parallel.py [MODEL_DIR] [--sizes 1 2] [--concurrency 1 8]

On the demo model's dense (fp16 checkpoint, bf16 compute on CPU) folder: for each TP size an
engine (rank 0 in this process, the other ranks spawned), then per concurrency that many
greedy requests on one prompt, 3 warm-up steps and `--steps` timed decode steps. tok/s =
tokens generated / wall time of the timed steps. "comm %" is rank 0's time inside the
all-reduces over the timed steps' wall time (it includes waiting for the slower rank: the
uneven 2 + 1 kv-head split gives rank 0 more attention work). The threads of each rank are
the cores shared out (`--num-threads`: that many per rank). Prints a table, writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from modelship.engine import EngineConfig, LLMEngine, SamplingParams
from modelship.model.tensor_parallel import communication_seconds

DEFAULT_MODEL = Path("modelship-data/models/smollm2-135m-instruct/base")
PROMPT = "The history of the city of Rome begins with"


def measure(engine: LLMEngine, concurrency: int, num_steps: int) -> dict[str, float]:
    ids = engine.tokenize(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=num_steps + 10, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"c{concurrency}-{i}", [*ids, i + 10], params)
    for _ in range(3):  # prefill, then decode
        engine.step()
    comm_before = communication_seconds(engine.model)
    tokens = 0
    start = time.perf_counter()
    for _ in range(num_steps):
        tokens += sum(len(delta.token_ids) for delta in engine.step())
    wall = time.perf_counter() - start
    comm = communication_seconds(engine.model) - comm_before
    while engine.has_unfinished():
        engine.step()
    return {"tok_s": tokens / wall, "step_ms": wall / num_steps * 1e3, "comm_share": comm / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path, nargs="?", default=DEFAULT_MODEL)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--num-threads", type=int, help="torch threads per rank (default: shared out)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    results = []
    print(f"{'TP':>3}{'conc':>6}{'tok/s':>9}{'step ms':>10}{'comm %':>8}")
    for size in args.sizes:
        engine = LLMEngine(
            args.model, EngineConfig(tensor_parallel_size=size, num_threads=args.num_threads)
        )
        try:
            for concurrency in args.concurrency:
                row = {"tp": size, "concurrency": concurrency,
                       **measure(engine, concurrency, args.steps)}  # fmt: skip
                results.append(row)
                print(f"{size:>3}{concurrency:>6}{row['tok_s']:>9.1f}{row['step_ms']:>10.1f}"
                      f"{row['comm_share'] * 100:>8.1f}")  # fmt: skip
        finally:
            engine.close()
    if args.out:
        data = {"model": str(args.model), "num_threads": args.num_threads, "results": results}
        args.out.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
