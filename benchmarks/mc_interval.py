"""How wide is the paired interval of a quality difference between two variants on the
standard multiple-choice set (BIG-bench social_iqa), and how many items per second does
scoring take? Prints a table and writes benchmarks/results/mc_interval.json.

    python benchmarks/mc_interval.py --model-root modelship-data/models/smollm2-135m-instruct \
        --cache modelship-data/cache/eval --items 300

The share difference is that of a quality share in which this set's retention (variant /
base) is one of three equally weighted parts (`pipeline/select/intervals.py`), so a
difference of the retention moves the share by a third of it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from modelship.pipeline.select.benchmark_data import load_benchmark
from modelship.pipeline.select.bootstrap import Resampler, mean_over, paired_difference
from modelship.pipeline.select.multiple_choice import score_choices
from modelship.pipeline.select.quality import Scorer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-root", type=Path, required=True)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--items", type=int, default=300)
    parser.add_argument("--variants", nargs=2, default=["gptq", "awq"])
    args = parser.parse_args()
    bench = load_benchmark(args.cache, ["social_iqa"], args.items)
    folders = {"base": args.model_root / "base"}
    folders |= {v: args.model_root / "optimized" / v for v in args.variants}
    per_item: dict[str, dict[str, np.ndarray]] = {}
    seconds: dict[str, float] = {}
    for name, folder in folders.items():
        scorer = Scorer(folder, max_model_len=512)  # questions are < 200 tokens
        started = time.perf_counter()
        scores = score_choices(scorer, bench.items)
        seconds[name] = time.perf_counter() - started
        per_item[name] = {
            "acc": np.array([s.correct for s in scores], float),
            "acc_norm": np.array([s.correct_norm for s in scores], float),
            "choice_prob": np.array([s.choice_prob for s in scores]),
        }
        del scorer
    at = Resampler().indices("benchmark", len(bench.items))
    a, b = args.variants
    rows = {}
    for metric in ("acc", "acc_norm", "choice_prob"):
        reps = {n: mean_over(v[metric], at) for n, v in per_item.items()}
        point = {n: float(v[metric].mean()) for n, v in per_item.items()}
        share = {n: np.minimum(reps[n] / reps["base"], 1.0) / 3 for n in args.variants}
        interval = paired_difference(share[a], share[b])
        rows[metric] = {
            **{n: point[n] for n in folders},
            "share_difference_ci95": interval.to_list(),
            "share_difference_width_points": 100 * (interval.high - interval.low),
        }
    print(f"{len(bench.items)} items; scoring seconds per variant: "
          + ", ".join(f"{n} {s:.1f}" for n, s in seconds.items()))  # fmt: skip
    print(f"{'metric':<12} {'base':>7} {a:>7} {b:>7}  {a}-{b} share diff 95% CI (width, points)")
    for metric, r in rows.items():
        low, high = r["share_difference_ci95"]
        width = r["share_difference_width_points"]
        print(f"{metric:<12} {r['base']:7.3f} {r[a]:7.3f} {r[b]:7.3f}  "
              f"[{100 * low:+.2f}, {100 * high:+.2f}] ({width:.2f})")  # fmt: skip
    out = Path(__file__).with_name("results") / "mc_interval.json"
    out.write_text(json.dumps({"benchmark": bench.describe(), "seconds": seconds,
                               "metrics": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
