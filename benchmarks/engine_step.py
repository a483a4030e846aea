"""Wall time of one engine step (decode) at fixed batch sizes, on the demo model's int4 variant.

    .venv/bin/python benchmarks/engine_step.py [MODEL_DIR] [--batch-sizes 1 16] [--no-fused-decoder]
        [--threads N] [--adaptive] [--lm-head auto|int8|int4|dense]

Each batch size: that many greedy requests on one short prompt, 5 warm-up steps, then
`--steps` timed `LLMEngine.step()` calls (scheduler, model, head, sampler, detokenizer).
Prints min / p10 / median per batch size; the machine is shared, so compare minima and
p10s of side-by-side runs. Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from modelship.engine import EngineConfig, LLMEngine, SamplingParams

DEFAULT_MODEL = Path("modelship-data/models/smollm2-135m-instruct/optimized/gptq")
PROMPT = "The history of the city of Rome begins with"


def time_steps(engine: LLMEngine, batch_size: int, num_steps: int) -> list[float]:
    ids = engine.tokenize(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=num_steps + 10, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"b{batch_size}-{i}", [*ids, i + 10], params)
    for _ in range(5):
        engine.step()
    seconds = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return sorted(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path, nargs="?", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--no-fused-decoder", action="store_true", help="layer by layer")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument(
        "--adaptive", action="store_true", help="adaptive_threads: each step on 1 or all threads"
    )
    parser.add_argument("--lm-head", default="auto", help="output head: auto, int8, int4, dense")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    config = EngineConfig(
        fused_decoder=not args.no_fused_decoder,
        num_threads=args.threads,
        adaptive_threads=args.adaptive,
        lm_head=args.lm_head,
    )
    engine = LLMEngine(args.model, config)
    results = {}
    print(f"{'batch':>5}{'min ms':>10}{'p10 ms':>10}{'median ms':>12}{'mean ms':>10}")
    for batch_size in args.batch_sizes:
        seconds = time_steps(engine, batch_size, args.steps)
        row = {
            "min_ms": seconds[0] * 1e3,
            "p10_ms": seconds[len(seconds) // 10] * 1e3,
            "median_ms": statistics.median(seconds) * 1e3,
            "mean_ms": statistics.fmean(seconds) * 1e3,
        }
        results[batch_size] = row
        print(
            f"{batch_size:>5}{row['min_ms']:>10.2f}{row['p10_ms']:>10.2f}{row['median_ms']:>12.2f}"
            f"{row['mean_ms']:>10.2f}"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
