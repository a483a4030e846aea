"""Reliability drills: provoke failures on real processes, check the pass rules, report.

    .venv/bin/python benchmarks/drills.py                   # every drill, full versions
    .venv/bin/python benchmarks/drills.py --quick           # the bounded versions (make test)
    .venv/bin/python benchmarks/drills.py --only fuzz,engine_faults --model tiny
    .venv/bin/python benchmarks/drills.py --only soak --soak-minutes 20

Each drill starts its own servers or fleet on 127.0.0.1, is bounded in time, and states
its pass rules as named checks (`benchmarks/drill/*.py`, one module a drill; the module
docstring says what it provokes). `--model`: a model folder, `demo` (the shipped demo
model, acquired into `--storage`; the default) or `tiny` (a random two-layer model made
on the spot, what the test suite uses). Prints one line per drill and its figures, then
every failed check; writes JSON (default benchmarks/results/drills.json). Exit code 1 if
any drill failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drill.common import DrillContext, DrillResult, run_drill

# name -> module under drill/ with a `run(context) -> DrillResult`; in the order
DRILLS = {
    "fuzz": "drill.fuzz",
    "overload": "drill.overload",
    "engine_faults": "drill.engine_faults",
    "fleet_faults": "drill.fleet_faults",
    "rollout": "drill.rollout",
    "storage_faults": "drill.storage_faults",
    "tenants": "drill.tenants",
    "soak": "drill.soak",
}
NOT_BY_DEFAULT = {"soak"}  # 20 minutes: only when asked for


def available_drills() -> dict[str, str]:
    """The drills whose module exists in this checkout."""
    here = Path(__file__).resolve().parent / "drill"
    return {name: module for name, module in DRILLS.items() if (here / f"{name}.py").exists()}


def resolve_model(model: str, storage: Path, work_dir: Path) -> Path:
    if model == "tiny":
        from tiny_models import make_tiny_llama

        return make_tiny_llama(work_dir / "tiny-model")
    if model == "demo":
        from modelship.pipeline.acquire import acquire
        from modelship.storage import Storage

        return acquire("demo", Storage(storage)).path
    path = Path(model)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {model}: no config.json there (a folder, demo or tiny)")
    return path


def run(names: list[str], context: DrillContext) -> list[DrillResult]:
    results = []
    for name in names:
        module = importlib.import_module(available_drills()[name])
        drill_context = replace(context, work_dir=context.work_dir / name)
        result = run_drill(name, module.run, drill_context)
        results.append(result)
        figures = ", ".join(f"{k}={v}" for k, v in result.figures.items())
        state = "pass" if result.passed else "FAIL"
        print(f"{name:<16}{state:<6}{result.seconds:>7.1f}s  {figures}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma-separated drills (default: all but soak)")
    parser.add_argument("--quick", action="store_true", help="the bounded versions")
    parser.add_argument("--soak-minutes", type=float, default=20.0, help="the soak's length")
    parser.add_argument("--model", default="demo", help="a model folder, demo or tiny")
    parser.add_argument("--storage", type=Path, default=Path("./modelship-data"))
    parser.add_argument("--work-dir", type=Path, help="kept afterwards (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/drills.json"))
    args = parser.parse_args()
    known = available_drills()
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SystemExit(f"--only: unknown drill(s) {unknown}; known: {', '.join(known)}")
    else:
        names = [n for n in known if n not in NOT_BY_DEFAULT]
    with tempfile.TemporaryDirectory(prefix="drills-") as temp:
        work_dir = args.work_dir or Path(temp)
        model_dir = resolve_model(args.model, args.storage, work_dir)
        results = run(names, DrillContext(model_dir, work_dir, args.quick, args.soak_minutes))
    failed = [r for r in results if not r.passed]
    for result in failed:
        for line in result.failures():
            print(f"  {result.drill}: {line}")
    print(f"{len(results) - len(failed)}/{len(results)} drills passed")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"model": str(model_dir), "quick": args.quick,
              "drills": [r.to_dict() for r in results]}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
