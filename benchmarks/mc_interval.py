"""How wide is the paired interval of a quality difference between two variants on the
standard multiple-choice set (BIG-bench social_iqa), and how many items per second does
scoring take? Prints a table and writes benchmarks/results/mc_interval.json.

    python benchmarks/mc_interval.py --model-root modelship-data/models/smollm2-135m-instruct \
        --cache modelship-data/cache/eval --items 2000

Per metric (acc, acc_norm, choice_prob): each model's value and the paired 95% interval of
the difference of the two variants' retentions (variant / base, capped at 1), which is the
benchmark's part of the quality share; select averages it with the other parts (task
accuracy, held-out cross-entropy, tool calls where the base calls any right), so it moves
the share by a quarter of itself (a third without tools). Where select has already measured
the variants (`<model-root>/evaluations/{base,A,B}.json`, or --evaluations), the whole
quality share difference is given too, with and without this set's acc_norm part: the
interval the issue's target is about. Each model's per-item scores are kept under
benchmarks/results/mc_interval_items/ and reused by a rerun on the same folder and items,
so an interrupted measurement resumes (and a run on fewer items reuses the first ones);
--score-only NAME scores one model and stops, for models scored by processes in parallel.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from modelship.pipeline.select.benchmark_data import BenchmarkSet, load_benchmark
from modelship.pipeline.select.bootstrap import Resampler, mean_over, paired_difference
from modelship.pipeline.select.intervals import estimate
from modelship.pipeline.select.multiple_choice import score_choices
from modelship.pipeline.select.quality import Scorer

RESULTS = Path(__file__).with_name("results")
METRICS = {"acc": "correct", "acc_norm": "correct_norm", "choice_prob": "choice_prob"}
CHUNK = 250  # items scored between progress lines


def score_folder(name: str, folder: Path, bench: BenchmarkSet) -> dict:
    """{metric: per-item list, "seconds": scoring time}, from the kept file when it was
    made on the same folder and items."""
    kept = RESULTS / "mc_interval_items" / f"{name}.json"
    key = {"folder": str(folder), "tasks": bench.tasks}
    n = len(bench.items)
    if kept.is_file():
        data = json.loads(kept.read_text())
        # one task's items are its file's first ones: a kept longer run holds these
        if data["key"] == key and len(data["scores"]["acc"]) >= n:
            print(f"{name}: per-item scores from {kept}")
            return {k: v[:n] if isinstance(v, list) else v for k, v in data["scores"].items()}
    scorer = Scorer(folder, max_model_len=512)  # questions are < 200 tokens
    scores: dict = {metric: [] for metric in METRICS}
    started, cpu_started = time.perf_counter(), time.process_time()
    for at in range(0, len(bench.items), CHUNK):
        for score in score_choices(scorer, bench.items[at : at + CHUNK]):
            for metric, field in METRICS.items():
                scores[metric].append(float(getattr(score, field)))
        done = min(at + CHUNK, len(bench.items))
        print(f"{name}: {done}/{len(bench.items)} items, {time.perf_counter() - started:.0f} s",
              flush=True)  # fmt: skip
    scores["seconds"] = time.perf_counter() - started
    scores["cpu_seconds"] = time.process_time() - cpu_started  # all threads: load-independent
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps({"key": key, "scores": scores}))
    return scores


def whole_share_differences(evaluations: Path, names: list[str], scores: dict) -> dict | None:
    """The quality share difference names[1] - names[2] as select computes it from its
    evaluations, without and with this set's items; None when an evaluation is missing."""
    paths = {name: evaluations / f"{name}.json" for name in names}
    if not all(path.is_file() for path in paths.values()):
        return None
    loaded = {name: json.loads(path.read_text()) for name, path in paths.items()}
    out = {}
    for label, with_benchmark in (("without_benchmark", False), ("with_benchmark", True)):
        evals = {}
        for name, evaluation in loaded.items():
            items = {
                key: values
                for key, values in evaluation["quality"]["items"].items()
                if not key.startswith("benchmark_")
            }
            if with_benchmark:
                items["benchmark_correct"] = [bool(v) for v in scores[name]["acc"]]
                items["benchmark_correct_norm"] = [bool(v) for v in scores[name]["acc_norm"]]
                items["benchmark_choice_prob"] = scores[name]["choice_prob"]
            evals[name] = {"quality": {"items": items}}
        measured = estimate(evals, names[0], Resampler())
        difference = measured[names[1]].difference(measured[names[2]])
        out[label] = {
            "share": {n: measured[n].share.value for n in names[1:]},
            "difference": difference.value,
            "ci95": difference.interval.to_list(),
            "width_points": 100 * (difference.interval.high - difference.interval.low),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-root", type=Path, required=True)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--items", type=int, default=300)
    parser.add_argument("--variants", nargs=2, default=["gptq", "awq"])
    parser.add_argument("--score-only", help="only score and keep this model (base or a variant)")
    parser.add_argument("--evaluations", type=Path, help="default: <model-root>/evaluations")
    args = parser.parse_args()
    bench = load_benchmark(args.cache, ["social_iqa"], args.items)
    folders = {"base": args.model_root / "base"}
    folders |= {v: args.model_root / "optimized" / v for v in args.variants}
    if args.score_only:  # e.g. two variants scored by two processes at once, then combined
        score_folder(args.score_only, folders[args.score_only], bench)
        return
    scores = {name: score_folder(name, folder, bench) for name, folder in folders.items()}
    at = Resampler().indices("benchmark", len(bench.items))
    a, b = args.variants
    rows = {}
    for metric in METRICS:
        values = {n: np.array(s[metric]) for n, s in scores.items()}
        reps = {n: mean_over(v, at) for n, v in values.items()}
        kept = {n: np.minimum(reps[n] / reps["base"], 1.0) for n in args.variants}
        interval = paired_difference(kept[a], kept[b])
        rows[metric] = {
            **{n: float(v.mean()) for n, v in values.items()},
            "retention_difference_ci95": interval.to_list(),
            "retention_difference_width_points": 100 * (interval.high - interval.low),
        }
    seconds = {n: {"wall": s["seconds"], "cpu": s["cpu_seconds"]} for n, s in scores.items()}
    timings = ", ".join(f"{n} {s['wall']:.0f} / {s['cpu']:.0f}" for n, s in seconds.items())
    print(f"{len(bench.items)} items; scoring seconds per model (wall / cpu): {timings}")
    print(f"{'metric':<12} {'base':>7} {a:>7} {b:>7}  {a}-{b} retention diff 95% CI "
          "(width; as 1 of 4 share parts), points")  # fmt: skip
    for metric, r in rows.items():
        low, high = r["retention_difference_ci95"]
        width = r["retention_difference_width_points"]
        print(f"{metric:<12} {r['base']:7.3f} {r[a]:7.3f} {r[b]:7.3f}  "
              f"[{100 * low:+.2f}, {100 * high:+.2f}] ({width:.2f}; {width / 4:.2f})")  # fmt: skip
    whole = whole_share_differences(
        args.evaluations or args.model_root / "evaluations", ["base", a, b], scores
    )
    for label, r in (whole or {}).items():
        low, high = r["ci95"]
        print(f"quality share {a}-{b}, {label.replace('_', ' ')}: {100 * r['difference']:+.2f} "
              f"[{100 * low:+.2f}, {100 * high:+.2f}] (width {r['width_points']:.2f})")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mc_interval.json").write_text(json.dumps({
        "benchmark": bench.describe(), "seconds": seconds, "metrics": rows,
        "quality_share_difference": whole,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
