"""Pipeline benchmark: `modelship run demo --no-serve` from nothing, then memoized.

    .venv/bin/python benchmarks/pipeline.py [--storage DIR] [--sequential]

Runs the whole pipeline as a user does (a fresh storage root, so acquire converts the
GGUF and every variant is made), reads each step's wall time from the run's status.json,
reruns it to time the memoized case, and prints every variant's measured numbers and
the winner. `--sequential` also times optimize with one variant at a time (another
fresh root; several more minutes) for the parallel-vs-sequential comparison.
Writes JSON (default benchmarks/results/pipeline.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SLUG = "smollm2-135m-instruct"


def modelship(*args: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "modelship", *args], check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--storage", type=Path, help="fresh storage root (default: a temp dir)")
    parser.add_argument("--sequential", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline.json"))
    args = parser.parse_args()
    root = args.storage or Path(tempfile.mkdtemp(prefix="modelship-bench-"))
    if root.exists() and any(root.iterdir()):
        sys.exit(f"{root} is not empty: the benchmark measures a run from nothing")

    total = modelship("run", "demo", "--no-serve", "--storage", str(root))
    model = root / "models" / SLUG
    status = json.loads((model / "pipeline" / "status.json").read_text())
    memoized = modelship("run", "demo", "--no-serve", "--storage", str(root))
    production = model / "production"
    metrics = json.loads((production / "production_metrics.json").read_text())

    result: dict = {
        "total_s": total,
        "memoized_rerun_s": memoized,
        "steps": {name: step["seconds"] for name, step in status["steps"].items()},
        "winner": metrics["variant"],
        "release": metrics["release"],
        "variants": {},
    }
    optimize_steps = [s for n, s in status["steps"].items() if n.startswith("optimize:")]
    result["optimize_parallel_s"] = max(s["seconds"] for s in optimize_steps)
    result["optimize_sum_of_steps_s"] = sum(s["seconds"] for s in optimize_steps)
    for entry in metrics["ranking"]:
        evaluation = metrics["evaluations"][entry["variant"]]
        serving = evaluation.get("serving") or {}
        quality = evaluation.get("quality") or {}
        result["variants"][entry["variant"]] = {
            "passed": entry["passed"],
            "reasons": entry["reasons"],
            "score": entry["score"],
            "quality_share": evaluation.get("quality_share"),
            "perplexity": quality.get("perplexity"),
            "top1_agreement": quality.get("top1_agreement"),
            "kl_divergence": quality.get("kl_divergence"),
            "task_accuracy": quality.get("task_accuracy"),
            "ttft_ms": serving.get("ttft_s", float("nan")) * 1e3,
            "tpot_ms": serving.get("tpot_s", float("nan")) * 1e3,
            "throughput_tok_s": serving.get("throughput_tok_s"),
            "weight_mb": evaluation.get("weight_bytes", 0) / 1e6,
            "peak_rss_mb": (serving.get("peak_rss_bytes") or 0) / 1e6,
        }
    fp16 = result["variants"].get("fp16", {}).get("weight_mb")
    winner_mb = result["variants"][result["winner"]]["weight_mb"]
    result["winner_weight_share_of_fp16"] = winner_mb / fp16 if fp16 else None

    if args.sequential:
        seq_root = Path(tempfile.mkdtemp(prefix="modelship-bench-seq-"))
        modelship("acquire", "demo", "--storage", str(seq_root))
        result["optimize_sequential_s"] = modelship(
            "optimize", "--max-parallel", "1", "--storage", str(seq_root)
        )
        shutil.rmtree(seq_root, ignore_errors=True)

    print(f"\nstorage: {root}")
    print(f"{'stage':<18}{'seconds':>10}")
    for name, seconds in result["steps"].items():
        print(f"{name:<18}{seconds:>10.1f}")
    print(f"{'total (process)':<18}{total:>10.1f}")
    print(f"{'memoized rerun':<18}{memoized:>10.1f}")
    print(f"{'optimize parallel':<18}{result['optimize_parallel_s']:>10.1f}")
    if "optimize_sequential_s" in result:
        print(f"{'optimize sequential':<18}{result['optimize_sequential_s']:>10.1f}")
    print()
    header = ("variant", "pass", "score", "quality", "ppl", "agree", "KL", "tasks",
              "TTFT ms", "TPOT ms", "tok/s", "weights MB", "RSS MB")  # fmt: skip
    print("".join(f"{h:>11}" for h in header))
    for name, v in result["variants"].items():
        row = (name, "yes" if v["passed"] else "no", f"{v['score']:.3f}",
               f"{(v['quality_share'] or 0):.1%}", f"{v['perplexity'] or 0:.2f}",
               f"{(v['top1_agreement'] or 0):.1%}", f"{v['kl_divergence'] or 0:.3f}",
               f"{(v['task_accuracy'] or 0):.1%}", f"{v['ttft_ms']:.0f}", f"{v['tpot_ms']:.1f}",
               f"{v['throughput_tok_s'] or 0:.1f}", f"{v['weight_mb']:.1f}",
               f"{v['peak_rss_mb']:.0f}")  # fmt: skip
        print("".join(f"{c:>11}" for c in row))
    share = result["winner_weight_share_of_fp16"]
    print(f"\nwinner: {result['winner']} (release {result['release']}); weights "
          f"{share:.1%} of fp16" if share else f"\nwinner: {result['winner']}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
