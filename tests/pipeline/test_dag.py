"""The local DAG executor: order, fan-out, retries on transient errors only, status."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from modelship.config import RetryConfig
from modelship.pipeline.dag import DAG, Step
from modelship.pipeline.errors import PipelineError, TransientError


def test_dependencies_order_and_parallel_fan_out(tmp_path: Path) -> None:
    events: list[str] = []
    lock = threading.Lock()
    inside = {"now": 0, "max": 0}

    def work(name: str, seconds: float = 0.0):
        def run(ctx):
            with lock:
                events.append(f"start {name}")
                inside["now"] += 1
                inside["max"] = max(inside["max"], inside["now"])
            time.sleep(seconds)
            with lock:
                inside["now"] -= 1
                events.append(f"end {name}")
            return {"name": name}

        return run

    steps = [
        Step("a", work("a")),
        Step("b1", work("b1", 0.3), after=("a",)),
        Step("b2", work("b2", 0.3), after=("a",)),
        Step("c", work("c"), after=("b1", "b2")),
    ]
    records = DAG(steps, tmp_path, max_parallel=2).run()
    assert events[:2] == ["start a", "end a"] and events[-2:] == ["start c", "end c"]
    assert inside["max"] == 2  # b1 and b2 ran at the same time
    assert all(r.state == "done" and r.attempts == 1 for r in records.values())
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "done"
    assert status["steps"]["c"]["facts"] == {"name": "c"}
    assert (tmp_path / "logs" / "b1.log").read_text().count("done after 1 attempt") == 1


def test_transient_errors_are_retried_with_backoff(tmp_path: Path) -> None:
    calls = {"n": 0}
    sleeps: list[float] = []

    def flaky(ctx):
        calls["n"] += 1
        if calls["n"] < 3:
            raise TransientError("connection reset")
        return {"attempt": ctx.attempt}

    policy = RetryConfig(max_attempts=3, backoff_s=1.5, max_backoff_s=10)
    records = DAG([Step("flaky", flaky, retry=policy)], tmp_path, sleep=sleeps.append).run()
    assert records["flaky"].state == "done" and records["flaky"].attempts == 3
    assert sleeps == [1.5, 3.0]
    assert records["flaky"].facts == {"attempt": 3}


def test_permanent_failure_is_not_retried_and_blocks_dependents(tmp_path: Path) -> None:
    ran: list[str] = []

    def broken(ctx):
        raise ValueError("bad recipe")

    steps = [
        Step("broken", broken, retry=RetryConfig(max_attempts=5)),
        Step("independent", lambda ctx: ran.append("independent")),
        Step("after", lambda ctx: ran.append("after"), after=("broken",)),
    ]
    with pytest.raises(PipelineError, match=r"broken: ValueError: bad recipe.*after: not run"):
        DAG(steps, tmp_path).run()
    assert ran == ["independent"]
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "failed"
    assert status["steps"]["broken"]["attempts"] == 1
    assert status["steps"]["after"]["state"] == "blocked"
    assert "bad recipe" in (tmp_path / "logs" / "broken.log").read_text()


def test_unknown_dependency_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="depends on unknown step 'nope'"):
        DAG([Step("a", lambda ctx: None, after=("nope",))], tmp_path)
