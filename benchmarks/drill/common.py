"""What every drill shares: its result type, its context, and small probes of real
processes (logs, metrics, OpenAI error bodies)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# The drills start servers and fleets the way the test suite does; its process helpers
# (`tests/fleet_process.py`, `tests/tiny_models.py`, `tests/pipeline/pipeline_config.py`,
# ...) are shared rather than copied.
TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"
for _folder in (TESTS_DIR, TESTS_DIR / "pipeline"):  # pipeline/: its small pipeline config
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


@dataclass
class Check:
    """One pass rule of a drill and what was seen."""

    name: str
    passed: bool
    detail: str = ""


@dataclass
class DrillResult:
    drill: str
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None  # the drill itself broke (not a failed check)

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.passed for c in self.checks)

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(passed), detail))
        return bool(passed)

    def failures(self) -> list[str]:
        failed = [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]
        return failed + ([f"error: {self.error}"] if self.error else [])

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


@dataclass(frozen=True)
class DrillContext:
    """`model_dir`: the model every replica serves (the tiny test model in `make test`, the
    demo model from the command line). `quick`: the bounded version. Each drill gets its own
    `work_dir` for storage, configs and logs."""

    model_dir: Path
    work_dir: Path
    quick: bool = True
    soak_minutes: float = 20.0  # the soak drill's length


Drill = Callable[[DrillContext], DrillResult]


def run_drill(name: str, drill: Drill, context: DrillContext) -> DrillResult:
    """Run one drill; an exception inside it becomes the result's `error`, not a crash."""
    context.work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        result = drill(context)
    except Exception as exc:
        result = DrillResult(name, error=f"{type(exc).__name__}: {exc}")
    result.drill = name
    result.seconds = round(time.monotonic() - started, 1)
    return result


def is_openai_error(response: httpx.Response) -> bool:
    """An OpenAI error body: {"error": {"message": str, "type": str, ...}}."""
    try:
        body = response.json()
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
    )


def metric(url: str, name: str, headers: dict[str, str] | None = None, **labels: str) -> float:
    """Sum of the samples of `name` at `url`/metrics whose labels include `labels`."""
    text = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def wait_until(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return False


def secrets_found(paths: Iterable[Path], secrets: Iterable[str]) -> list[str]:
    """'<file>: <secret prefix>...' for each secret that appears in one of the files."""
    found = []
    secrets = [s for s in secrets if s]
    for path in paths:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        found += [f"{path.name}: {s[:6]}..." for s in secrets if s in text]
    return found


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]
