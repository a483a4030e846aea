"""Cold start of a replica: seconds from `modelship serve` to its first 200 on /ready.

    .venv/bin/python benchmarks/cold_start.py                        # the demo's gptq variant
    .venv/bin/python benchmarks/cold_start.py --model-dir PATH --runs 5

Each run starts a fresh `modelship serve` process (the warm-up step included, as a replica
in a fleet would), waits for /ready, and stops it. Both engine placements are measured:
the engine core in its own process (the default) and on a thread of the server. The OS
page cache is warm after the first run, as on a node that restarts a replica; the first
run is reported apart. Prints a table and writes JSON (default
benchmarks/results/cold_start.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from modelship.pipeline.acquire import DEMO_SLUG
from modelship.server.process import ReplicaProcess


def time_to_ready(model_dir: Path, flag: str) -> float:
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "cold-start.log"
    replica = ReplicaProcess(model_dir, "--engine-core", flag, log_path=log)
    try:
        return replica.wait_ready(timeout_s=300)
    finally:
        replica.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", default="./modelship-data")
    parser.add_argument("--model-dir", help="a model folder (default: the demo's gptq variant)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/cold_start.json")
    args = parser.parse_args()
    model_dir = Path(
        args.model_dir or Path(args.storage) / "models" / DEMO_SLUG / "optimized" / "gptq"
    )
    if not (model_dir / "config.json").is_file():
        parser.error(f"{model_dir} is not a model folder (run `make run` first, or --model-dir)")

    rows = []
    placements = (("engine process", "process"), ("engine thread", "thread"))
    for name, flag in placements:
        first = time_to_ready(model_dir, flag)
        times = [time_to_ready(model_dir, flag) for _ in range(args.runs)]
        rows.append(
            {
                "placement": name,
                "first_s": first,
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "runs": times,
            }
        )
    print(f"{'placement':<16} {'first s':>8} {'median s':>9} {'min s':>7} {'max s':>7}")
    for row in rows:
        print(
            f"{row['placement']:<16} {row['first_s']:>8.2f} {row['median_s']:>9.2f} "
            f"{row['min_s']:>7.2f} {row['max_s']:>7.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model_dir": str(model_dir), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
