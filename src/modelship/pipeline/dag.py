"""A small local DAG executor: steps with dependencies, parallel fan-out, retries, status.

Each step is a function; what it produces lives in storage (published atomically by the
stage), and every stage is itself memoized on a hash of its inputs, so a rerun of a
finished pipeline finds everything in place and does no work, and a rerun after a crash
redoes only what was not published. The executor adds what a single stage cannot:
ordering, parallelism, retries with backoff for transient errors (per-step policy),
per-step logs, and `status.json` (each step's state, attempts and timing), rewritten
atomically on every change so `modelship status` can read it at any time.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelship.config import RetryConfig
from modelship.liveness import alive_here
from modelship.pipeline.errors import PipelineError, TransientError
from modelship.storage import write_json_atomic
from modelship.storage.manifest import now_iso

TRANSIENT = (TransientError, ConnectionError, TimeoutError, BrokenProcessPool)
# Step states, in the order a step goes through them.
PENDING, RUNNING, RETRYING, DONE, FAILED, BLOCKED = (
    "pending", "running", "retrying", "done", "failed", "blocked",
)  # fmt: skip
INTERRUPTED = "interrupted"  # read back only: the process that ran it is gone


@dataclass
class StepContext:
    name: str
    attempt: int
    log: logging.Logger
    log_path: Path


@dataclass
class Step:
    name: str
    run: Callable[[StepContext], dict[str, Any] | None]  # returns facts for status.json
    after: tuple[str, ...] = ()
    retry: RetryConfig = field(default_factory=RetryConfig)


@dataclass
class StepRecord:
    state: str = PENDING
    attempts: int = 0
    started_at: str | None = None
    finished_at: str | None = None
    seconds: float | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    log: str | None = None


class DAG:
    def __init__(
        self,
        steps: list[Step],
        run_dir: Path,
        *,
        max_parallel: int = 4,
        on_change: Callable[[str, StepRecord], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        names = [s.name for s in steps]
        if len(set(names)) != len(names):
            raise ValueError("step names must be unique")
        for step in steps:
            for dep in step.after:
                if dep not in names:
                    raise ValueError(f"step {step.name!r} depends on unknown step {dep!r}")
        self.steps = {s.name: s for s in steps}
        self.run_dir = run_dir
        self.max_parallel = max_parallel
        self.on_change = on_change
        self.sleep = sleep
        self.records = {name: StepRecord() for name in names}
        self._lock = threading.Lock()
        # Who runs it: `modelship status` tells a killed run from a live one by this.
        self._status: dict[str, Any] = {
            "started_at": now_iso(),
            "state": RUNNING,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
        }

    @property
    def status_path(self) -> Path:
        return self.run_dir / "status.json"

    def run(self) -> dict[str, StepRecord]:
        """Run every step whose dependencies succeeded; raise if any step failed."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self._write_status()
        running: dict[Future, str] = {}
        with ThreadPoolExecutor(max_workers=self.max_parallel) as pool:
            while True:
                for name in self._ready(set(running.values())):
                    running[pool.submit(self._attempt_all, name)] = name
                if not running:
                    break
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    running.pop(future)
                self._block_dependents()
        failed = {n: r for n, r in self.records.items() if r.state in (FAILED, BLOCKED)}
        self._status["state"] = FAILED if failed else DONE
        self._status["finished_at"] = now_iso()
        self._write_status()
        if failed:
            reasons = "; ".join(
                f"{name}: {record.error or record.state}" for name, record in failed.items()
            )
            raise PipelineError(f"pipeline failed: {reasons}")
        return self.records

    def _ready(self, running: set[str]) -> list[str]:
        ready = []
        for name, step in self.steps.items():
            record = self.records[name]
            if record.state != PENDING or name in running:
                continue
            if all(self.records[dep].state == DONE for dep in step.after):
                ready.append(name)
        return ready

    def _block_dependents(self) -> None:
        changed = True
        while changed:
            changed = False
            for name, step in self.steps.items():
                record = self.records[name]
                bad = [d for d in step.after if self.records[d].state in (FAILED, BLOCKED)]
                if record.state == PENDING and bad:
                    record.state = BLOCKED
                    record.error = f"not run: {', '.join(bad)} failed"
                    self._changed(name)
                    changed = True

    def _attempt_all(self, name: str) -> None:
        step, record = self.steps[name], self.records[name]
        log_path = self.run_dir / "logs" / f"{name.replace(':', '-')}.log"
        logger = _step_logger(name, log_path)
        record.log = str(log_path)
        record.started_at = now_iso()
        started = time.perf_counter()
        while True:
            record.attempts += 1
            record.state = RUNNING
            self._changed(name)
            context = StepContext(name, record.attempts, logger, log_path)
            try:
                record.facts = step.run(context) or {}
            except Exception as exc:
                message = f"{type(exc).__name__}: {exc}".splitlines()[0]
                logger.exception("attempt %d failed", record.attempts)
                transient = isinstance(exc, TRANSIENT)
                if transient and record.attempts < step.retry.max_attempts:
                    delay = min(
                        step.retry.backoff_s * 2 ** (record.attempts - 1), step.retry.max_backoff_s
                    )
                    record.state, record.error = RETRYING, f"{message} (retrying in {delay:.0f}s)"
                    self._changed(name)
                    self.sleep(delay)
                    continue
                record.state, record.error = FAILED, message
                break
            record.state, record.error = DONE, None
            break
        record.finished_at = now_iso()
        record.seconds = round(time.perf_counter() - started, 2)
        logger.info("%s after %d attempt(s), %.1fs", record.state, record.attempts, record.seconds)
        _close_logger(logger)
        self._changed(name)

    def _changed(self, name: str) -> None:
        self._write_status()
        if self.on_change is not None:
            self.on_change(name, self.records[name])

    def _write_status(self) -> None:
        with self._lock:
            status = dict(self._status)
            status["steps"] = {name: dict(record.__dict__) for name, record in self.records.items()}
            write_json_atomic(self.status_path, status)


def _step_logger(name: str, path: Path) -> logging.Logger:
    logger = logging.getLogger(f"modelship.step.{name}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    return logger


def _close_logger(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        handler.close()
        logger.removeHandler(handler)


def read_status(run_dir: Path) -> dict[str, Any] | None:
    """status.json as written, except that a run whose process is gone (killed, or its
    machine rebooted) reads as `interrupted`, with its unfinished steps, instead of
    `running` forever."""
    import json

    path = run_dir / "status.json"
    if not path.is_file():
        return None
    status = json.loads(path.read_text())
    if status.get("state") == RUNNING and not alive_here(status.get("hostname"), status.get("pid")):
        status["state"] = INTERRUPTED
        for step in status.get("steps", {}).values():
            if step.get("state") in (RUNNING, RETRYING):
                step["state"] = INTERRUPTED
    return status
