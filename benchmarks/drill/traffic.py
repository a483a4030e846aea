"""Closed-loop client traffic through the official `openai` SDK, every outcome kept.

The fleet drills (`fleet_faults`, `rollout`) provoke a fault while this runs and then
judge what the clients saw: which requests succeeded, which failed and how, whether any
hung past its timeout, and which release answered.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import httpx
import openai


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it (times on `time.monotonic()`)."""

    worker: int
    stream: bool
    started: float
    ended: float
    ok: bool
    # connection (nothing or a broken connection), timeout (the client gave up: a hang),
    # status (an HTTP error status), stream_error (an error event mid-stream),
    # truncated (a stream that ended without finish_reason and without an error),
    # invalid (a 200 whose body the SDK could not read)
    error: str | None = None
    detail: str = ""
    release: str | None = None  # x-modelship-release, when the gateway answered

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class Traffic:
    """`num_threads` clients, each sending one chat completion after another until
    `stop()`. The SDK never retries (`max_retries=0`):
    every failure the gateway lets through is seen here. About half the requests stream.
    Each request has its own `user` (`{user_prefix}{worker}-{n}`), so a canary split sees
    many sessions."""

    def __init__(
        self,
        base_url: str,
        model: str,
        num_threads: int,
        max_tokens: int = 8,
        timeout_s: float = 60.0,
        api_key: str = "none",
        user_prefix: str = "u",
        pause_s: float = 0.0,
    ) -> None:
        self.client = openai.OpenAI(
            base_url=f"{base_url}/v1",
            api_key=api_key,
            max_retries=0,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
        )
        self.model = model
        self.max_tokens = max_tokens
        self.user_prefix = user_prefix
        self.pause_s = pause_s
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_threads)
        ]

    def start(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=timeout_s)
        return self.snapshot()

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def num_ok(self) -> int:
        return sum(o.ok for o in self.snapshot())

    def wait_ok(self, count: int, timeout_s: float) -> bool:
        """Wait until `count` more requests than now have succeeded."""
        target = self.num_ok() + count
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.num_ok() >= target:
                return True
            time.sleep(0.1)
        return False

    def _run(self, worker: int) -> None:
        # Streaming or not at random (seeded): requests in lockstep with a round-robin
        # router would otherwise send all of one kind to one replica.
        rng = random.Random(worker)
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = rng.random() < 0.5
            outcome = self.ask(worker, f"{self.user_prefix}{worker}-{n}", stream, n)
            with self._lock:
                self.outcomes.append(outcome)
            if outcome.error == "connection":
                time.sleep(0.1)  # nothing listens: a client would not spin either
            elif self.pause_s:
                time.sleep(self.pause_s)

    def ask(self, worker: int, user: str, stream: bool, n: int = 0) -> Outcome:
        messages = [{"role": "user", "content": f"request {n} from {user}: tell me a story"}]
        started = time.monotonic()

        def done(ok: bool, error: str | None = None, detail: str = "", release=None) -> Outcome:
            return Outcome(
                worker, stream, started, time.monotonic(), ok, error, detail[:300], release
            )

        release = None
        try:
            raw = self.client.chat.completions.with_raw_response.create(
                model=self.model,
                messages=messages,
                max_tokens=self.max_tokens,
                user=user,
                stream=stream,
            )
            release = raw.headers.get("x-modelship-release")
            if not stream:
                answer = raw.parse()
                finish = answer.choices[0].finish_reason if answer.choices else None
                if finish not in ("stop", "length"):
                    return done(False, "invalid", f"finish_reason {finish!r}", release)
                return done(True, release=release)
            finish = None
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            if finish is None:
                return done(False, "truncated", "stream ended without finish_reason", release)
            return done(True, release=release)
        except openai.APITimeoutError as exc:
            return done(False, "timeout", repr(exc), release)
        except openai.APIConnectionError as exc:
            cause = exc.__cause__
            return done(False, "connection", f"{exc!r} <- {cause!r}", release)
        except openai.APIStatusError as exc:
            return done(False, "status", f"{exc.status_code} {exc.message}", release)
        except (ValueError, openai.APIResponseValidationError) as exc:
            return done(False, "invalid", repr(exc), release)
        except openai.APIError as exc:  # an error event in a stream
            return done(False, "stream_error", exc.message, release)
        except httpx.HTTPError as exc:  # broken mid-stream, below the SDK's own mapping
            kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "connection"
            return done(False, kind, repr(exc), release)


def tally(outcomes: list[Outcome]) -> dict[str, int]:
    """sent / succeeded / failed, and failures by kind."""
    counts = {"sent": len(outcomes), "ok": sum(o.ok for o in outcomes)}
    counts["failed"] = counts["sent"] - counts["ok"]
    for outcome in outcomes:
        if not outcome.ok:
            counts[outcome.error or "unknown"] = counts.get(outcome.error or "unknown", 0) + 1
    return counts


def describe(outcomes: list[Outcome], limit: int = 3) -> str:
    failed = [o for o in outcomes if not o.ok]
    shown = "; ".join(f"{o.error} after {o.seconds:.1f}s: {o.detail}" for o in failed[:limit])
    return f"{tally(outcomes)}" + (f"; e.g. {shown}" if shown else "")
