"""A standard multiple-choice set for select, from a package on PyPI (no Hub at run time).

BIG-bench (Apache-2.0) ships its tasks as `bigbench/benchmark_tasks/<task>/task.json` in the
`bigbench` sdist (358 MB). `fetch` downloads that sdist once with pip, checks its sha256
against the pinned one, and extracts only the wanted tasks, each converted to a small JSONL
file of items (`{"input", "choices", "answer"}`) written atomically under the cache folder;
the sdist is then deleted. `load_benchmark` reads those files and nothing else: select never
downloads, and a missing file is an error that names it and the command that fetches it
(`make data`). Which items were scored (source, version, sdist checksum, each task file's
checksum) is `BenchmarkSet.describe()`, recorded with every evaluation so reruns are
comparable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "bigbench"
VERSION = "1.0.0"
SDIST = f"{PACKAGE}-{VERSION}.tar.gz"
SDIST_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
# Commonsense question answering with the choices written out (social_iqa, 1954 items, 3
# choices): a 135M model scores above chance there, which a gate needs; tasks whose choices
# are letters ("a"/"b") leave a small model at chance whatever its quantization.
DEFAULT_TASKS = ("social_iqa",)
FETCH_COMMAND = "make data"


class BenchmarkDataError(RuntimeError):
    """The benchmark's files are missing or do not match their checksum."""


@dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice question: `context` is scored before each of `choices`."""

    id: str
    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class BenchmarkSet:
    items: list[ChoiceItem]
    tasks: dict[str, str]  # task -> sha256 of its JSONL file

    def describe(self) -> dict:
        return {
            "dataset": PACKAGE,
            "version": VERSION,
            "sdist_sha256": SDIST_SHA256,
            "tasks": self.tasks,
            "num_items": len(self.items),
        }


def task_path(cache: Path, task: str) -> Path:
    return cache / f"{PACKAGE}-{VERSION}" / f"{task}.jsonl"


def context_for(question: str) -> str:
    """The prompt a choice is scored after (BIG-bench's default Q:/A: prefixes)."""
    return f"Q: {question.strip()}\nA:"


def convert_task(task: str, data: dict) -> list[dict]:
    """BIG-bench task.json -> items: choices in the file's order, the answer the one with
    the highest target score; examples without a single best choice are left out."""
    rows = []
    for number, example in enumerate(data.get("examples", [])):
        scores = example.get("target_scores")
        if not scores or len(scores) < 2:
            continue
        best = max(scores.values())
        if list(scores.values()).count(best) != 1:
            continue
        choices = list(scores)
        rows.append(
            {
                "id": f"{task}/{number}",
                "input": example["input"],
                "choices": choices,
                "answer": choices.index(next(c for c in choices if scores[c] == best)),
            }
        )
    return rows


def extract_tasks(sdist: Path, tasks: list[str], cache: Path) -> None:
    """Write each task's JSONL file (atomically) from the sdist; raises BenchmarkDataError
    for a task the sdist does not have."""
    wanted = {f"{PACKAGE}-{VERSION}/bigbench/benchmark_tasks/{t}/task.json": t for t in tasks}
    found: set[str] = set()
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive:  # one pass over the stream: the archive is large
            task = wanted.get(member.name)
            if task is None or not member.isfile():
                continue
            data = json.load(archive.extractfile(member))
            _write_atomic(task_path(cache, task), convert_task(task, data))
            found.add(task)
    missing = sorted(set(tasks) - found)
    if missing:
        raise BenchmarkDataError(f"{sdist.name} has no task named {', '.join(missing)}")


def _write_atomic(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared like the storage
    os.replace(tmp, path)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(cache: Path, tasks: list[str], sdist: Path | None = None) -> None:
    """Make every task's file present under `cache`: nothing to do when all are; otherwise
    the sdist (`sdist`, or downloaded with pip into a temporary folder and deleted after)
    is checked against the pinned sha256 and the missing tasks extracted."""
    missing = [t for t in tasks if not task_path(cache, t).is_file()]
    if not missing:
        return
    with tempfile.TemporaryDirectory(prefix="modelship-bigbench-") as tmp:
        if sdist is None:
            sdist = Path(tmp) / SDIST
            # --no-build-isolation: pip still prepares the sdist's metadata, with the
            # setuptools already installed rather than a fresh one from the index.
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                       ":all:", "--no-build-isolation", f"{PACKAGE}=={VERSION}",
                       "-d", tmp]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0 or not sdist.is_file():
                raise BenchmarkDataError(
                    f"could not download {SDIST} with pip (offline?): "
                    f"{done.stderr.strip().splitlines()[-1:] or done.returncode}"
                )
        actual = sha256_of(sdist)
        if actual != SDIST_SHA256:
            raise BenchmarkDataError(f"{sdist} has sha256 {actual}, expected {SDIST_SHA256}")
        extract_tasks(sdist, missing, cache)


def load_benchmark(cache: Path, tasks: list[str], max_items: int) -> BenchmarkSet:
    """The first `max_items` items, taken from the tasks in turn (a fixed order: the same
    files give the same items). Raises BenchmarkDataError naming a missing file."""
    per_task: list[list[ChoiceItem]] = []
    checksums: dict[str, str] = {}
    for task in tasks:
        path = task_path(cache, task)
        if not path.is_file():
            raise BenchmarkDataError(
                f"{path} is missing: the benchmark task {task!r} is fetched by "
                f"`{FETCH_COMMAND}` (python -m modelship.pipeline.select.benchmark_data "
                f"--cache {cache} {task})"
            )
        checksums[task] = sha256_of(path)
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        per_task.append(
            [
                ChoiceItem(
                    row["id"], context_for(row["input"]), tuple(row["choices"]), row["answer"]
                )
                for row in rows
            ]
        )
    items: list[ChoiceItem] = []
    for position in range(max((len(t) for t in per_task), default=0)):
        for task_items in per_task:
            if position < len(task_items) and len(items) < max_items:
                items.append(task_items[position])
    return BenchmarkSet(items, checksums)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"Fetch BIG-bench tasks from the {SDIST} sdist.")
    parser.add_argument("--cache", type=Path, required=True, help="e.g. modelship-data/cache/eval")
    parser.add_argument("--sdist", type=Path, help="an already downloaded sdist")
    parser.add_argument("tasks", nargs="*", default=list(DEFAULT_TASKS))
    args = parser.parse_args(argv)
    try:
        fetch(args.cache, args.tasks, args.sdist)
    except BenchmarkDataError as exc:
        sys.exit(f"error: {exc}")
    for task in args.tasks:
        path = task_path(args.cache, task)
        print(f"{path}  sha256 {sha256_of(path)}")


if __name__ == "__main__":
    main()
