"""Drill 6, storage faults: what a crash, a full disk, a race or a hand edit leaves on
shared storage. Every case drives the real CLI (`modelship run --no-serve`, `verify`).

- disk full: the run's writes fail past a file-size limit (RLIMIT_FSIZE: a write then
  fails with EFBIG, as one fails with ENOSPC on a full disk, without needing a small
  filesystem); the run must fail with an error, leave no half artifact, and a rerun
  without the limit must finish.
- kill -9 at every step of the run, resuming each time.
- two runs at once on one storage: both finish, one consistent storage.

The quick version (`make test`) makes variants with `modelship optimize` (fp16 only, or
fp16 + gptq for the kill) and leaves select out; the full one drives `modelship run`.
- a manifest edited by hand, a weights file truncated: `verify` names the file, and the
  next run redoes that artifact instead of failing or serving it.

Pass rule everywhere: every artifact folder visible under models/<slug> has a manifest
its files match (no half artifact), and production points at a verified release.
"""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from modelship.storage import Storage, StorageError, verify_artifact

from drill.common import DrillContext, DrillResult
from pipeline_config import TINY  # small calibration and measurement: the drill is about storage

SLUG = "drill"


def run(context: DrillContext) -> DrillResult:
    result = DrillResult("storage_faults")
    variants = ["fp16", "gptq"] if context.quick else ["fp16", "awq", "gptq"]
    made = _disk_full(context, variants[:1] if context.quick else variants, result)
    _kill_at_every_step(context, variants, result)
    _two_runs_at_once(context, variants, result)
    _hand_edits(context, made, result)
    return result


# Helpers -----------------------------------------------------------------------------------
def _config(context: DrillContext, storage: Path, variants: list[str]) -> Path:
    config = {
        **TINY,
        "source": str(context.model_dir),
        "name": SLUG,
        "storage": str(storage),
        "optimize": {**TINY["optimize"], "variants": variants},
    }
    path = storage.parent / f"{storage.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _command(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "modelship", *args, "--config", str(config)]


def _acquire(context: DrillContext, storage: Path, result: DrillResult, case: str) -> bool:
    acquired = subprocess.run(
        [sys.executable, "-m", "modelship", "acquire", str(context.model_dir), "--name", SLUG,
         "--storage", str(storage)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return result.check(f"{case}: acquire first", acquired.returncode == 0, acquired.stderr[-500:])


def _make(context: DrillContext, config: Path) -> list[str]:
    """The command that makes every artifact: `run` (full), `optimize` (quick)."""
    return _command(config, "optimize") if context.quick else _command(config, "run", "--no-serve")


def _run(
    context: DrillContext, config: Path, timeout_s: float = 900, limit_bytes: int | None = None
):
    def limit_file_size() -> None:  # in the child: every file it writes stays below this
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run(
        _make(context, config),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        preexec_fn=limit_file_size if limit_bytes else None,
    )


def storage_problems(root: Path) -> list[str]:
    """Every artifact folder under models/ that is not complete (no half artifact may be
    visible), and a production link that does not point at a verified release."""
    storage = Storage(root)
    problems = []
    for model in (root / "models").iterdir() if (root / "models").is_dir() else []:
        folders = [model / "base"]
        folders += [p for p in (model / "optimized").glob("*") if not p.name.startswith(".")]
        folders += [p for p in (model / "releases").glob("*") if not p.name.startswith(".")]
        for folder in folders:
            if not folder.exists() or folder.is_symlink():
                continue
            try:
                verify_artifact(folder)
            except StorageError as exc:
                problems.append(str(exc))
        production = storage.production_release(model.name)
        if production is not None:
            try:
                verify_artifact(storage.release_dir(model.name, production))
            except StorageError as exc:
                problems.append(f"production -> {exc}")
    return problems


def _status(storage: Path) -> dict:
    path = storage / "models" / SLUG / "pipeline" / "status.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# Cases --------------------------------------------------------------------------------------
def _disk_full(context: DrillContext, variants: list[str], result: DrillResult) -> Path:
    storage = context.work_dir / "disk-full"
    config = _config(context, storage, variants)
    if not _acquire(context, storage, result, "disk full"):
        return config
    base_bytes = max(p.stat().st_size for p in (storage / "models" / SLUG / "base").rglob("*"))
    limit = max(64 * 1024, base_bytes // 8)  # far below a variant's weights
    full = _run(context, config, limit_bytes=limit)
    said = (full.stderr + full.stdout).lower()
    result.check(
        "disk full: the run fails and says why",
        full.returncode != 0 and ("file too large" in said or "no space" in said),
        f"exit {full.returncode}; stderr tail: {full.stderr[-300:]!r}",
    )
    problems = storage_problems(storage)
    result.check("disk full: no half artifact", not problems, "; ".join(problems))
    resumed = _run(context, config)
    result.check(
        "disk full: rerun without the limit finishes",
        resumed.returncode == 0,
        resumed.stderr[-500:],
    )
    result.figures["disk_full_limit_bytes"] = limit
    return config


def _kill_at_every_step(context: DrillContext, variants: list[str], result: DrillResult) -> None:
    """kill -9 of `modelship run` inside each step in turn (quick: only in gptq, the step
    slow enough to catch), checking storage after each; then the run (quick: optimize)
    resumes and finishes."""
    storage = context.work_dir / "kill"
    config = _config(context, storage, variants)
    steps = ["acquire", *(f"optimize:{v}" for v in variants), "select"]
    if context.quick:
        steps = [f"optimize:{variants[-1]}"]
    killed, missed = [], []
    for step in steps:
        process = subprocess.Popen(
            _command(config, "run", "--no-serve"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and process.poll() is None:
            state = _status(storage).get("steps", {}).get(step, {}).get("state")
            if state == "running":
                time.sleep(0.3)  # inside the step's work, not at its first line
                process.send_signal(signal.SIGKILL)
                killed.append(step)
                break
            if state == "done":
                missed.append(step)  # too quick to catch on this machine
                break
            time.sleep(0.05)
        process.kill()
        process.wait()
        problems = storage_problems(storage)
        result.check(f"kill -9 in {step}: no half artifact", not problems, "; ".join(problems))
    resumed = _run(context, config)
    finished = resumed.returncode == 0 and all(
        (Storage(storage).variant_dir(SLUG, v) / "manifest.json").is_file() for v in variants
    )
    if not context.quick:
        finished = finished and _status(storage).get("state") == "done"
    result.check("kill -9: the run resumes and finishes", finished, resumed.stderr[-500:])
    result.figures["killed_in"] = ",".join(killed)
    if missed:
        result.figures["finished_before_kill"] = ",".join(missed)
    result.check("kill -9: at least one step was caught running", bool(killed), str(missed))


def _two_runs_at_once(context: DrillContext, variants: list[str], result: DrillResult) -> None:
    storage = context.work_dir / "race"
    config = _config(context, storage, variants)
    if context.quick and not _acquire(context, storage, result, "two runs at once"):
        return  # optimize, unlike run, does not acquire
    runs = [
        subprocess.Popen(
            _make(context, config), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outcomes = [r.communicate(timeout=1200) for r in runs]
    codes = [r.returncode for r in runs]
    result.check(
        "two runs at once: both finish",
        codes == [0, 0],
        f"exit codes {codes}; {[err[-300:] for _, err in outcomes]}",
    )
    problems = storage_problems(storage)
    result.check("two runs at once: storage consistent", not problems, "; ".join(problems))
    if not context.quick:
        result.figures["race_releases"] = len(Storage(storage).releases(SLUG))


def _edit_manifest(folder: Path) -> str:
    """Claim one more byte for the first file; returns that file's name."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][0]["size"] += 1
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest["files"][0]["path"]


def _truncate_weights(folder: Path) -> str:
    """Cut the largest safetensors file in half; returns its name."""
    weights = max(folder.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    return weights.name


def _hand_edits(context: DrillContext, config: Path, result: DrillResult) -> None:
    """On the storage the disk-full case finished, one damage at a time: `verify` must
    name the damaged file, and the next run must make that artifact again."""
    storage = Storage(yaml.safe_load(config.read_text())["storage"])
    variants = yaml.safe_load(config.read_text())["optimize"]["variants"]
    first, last = storage.variant_dir(SLUG, variants[0]), storage.variant_dir(SLUG, variants[-1])
    damages = [
        ("manifest edited", first, _edit_manifest),
        ("weights truncated", last, _truncate_weights),
    ]
    if not context.quick:  # the base is made again by acquire, which only `run` includes
        damages.append(("base weights truncated", storage.base_dir(SLUG), _truncate_weights))
    for what, folder, damage in damages:
        if not (folder / "manifest.json").is_file():
            result.check(f"{what}: a finished artifact to damage", False, f"{folder} missing")
            continue
        created = json.loads((folder / "manifest.json").read_text())["created_at"]
        named = damage(folder)
        checked = subprocess.run(
            [sys.executable, "-m", "modelship", "verify", str(folder)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        said = checked.stdout + checked.stderr
        result.check(
            f"{what}: verify fails naming {named}",
            checked.returncode != 0 and named in said,
            said[-300:],
        )
        time.sleep(1.0)  # created_at has one-second resolution
        rerun = _run(context, config)
        problems = storage_problems(storage.root)
        remade = (folder / "manifest.json").is_file() and json.loads(
            (folder / "manifest.json").read_text()
        )["created_at"] != created
        result.check(
            f"{what}: the next run makes it again",
            rerun.returncode == 0 and remade and not problems,
            f"exit {rerun.returncode}, remade {remade}, problems {problems}; "
            + rerun.stderr[-300:],
        )
