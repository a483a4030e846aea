"""Drill 4, fleet faults: replicas and the gateway failing under client load.

Clients are threads using the official `openai` SDK with retries off (`traffic.py`), about
half the requests streaming. Cases:

- kill -9 of a busy replica of `modelship up` (2 replicas): every non-streaming request
  succeeds (retried on the other replica), every stream completes or ends with an error
  the client sees, none hangs past its timeout; the fleet starts a replacement.
- SIGSTOP of a busy replica (hung, not dead), SIGCONT later: health checks route new
  requests around it and the attempts waiting on it are retried elsewhere, so requests
  keep succeeding within the request timeout; streams cut on it end with an error; once
  resumed it serves again (paused for less than `max_unresponsive_s`, it is not replaced).
  The full version also keeps one stopped past `max_unresponsive_s`: it is replaced.
- a replica that answers 500s and garbage (`tests/bad_replica.py`, a real HTTP server
  beside a real `modelship serve`, both behind `modelship gateway`): clients see only
  answers, the bad replica's breaker opens and it gets no more than a handful of requests
  (quick: both faults in turn; full: each alone).
- the gateway killed (-9) and restarted under load: clients see connection errors only for
  the requests in flight or sent while it was down, everything after the restart works,
  and the replicas' abandoned work is cancelled; the full version also restarts it
  gracefully (SIGTERM): then no request in flight fails.

Figures: requests sent / succeeded / failed per case, time to route around the hung
replica, time to replace the killed one (and, full, the hung one).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import yaml

from modelship.server.process import ReplicaProcess, bind_socket
from modelship.storage import Storage

from bad_replica import BadReplica
from drill.common import DrillContext, DrillResult, metric, wait_until
from drill.traffic import Outcome, Traffic, describe, tally
from fleet_process import UpProcess
from fleet_storage import publish_release

SLUG = "drill"
ENGINE = {"max_model_len": 256, "kv_cache_memory_mb": 16}
REQUEST_TIMEOUT_S = 20.0  # the gateway's; clients wait a little longer to tell a hang
CLIENT_TIMEOUT_S = REQUEST_TIMEOUT_S + 10.0
MAX_TOKENS = 12
NUM_CLIENTS = 4
MAX_UNRESPONSIVE_S = 20.0  # the supervisor replaces a replica silent for longer
RESILIENCE = {
    "breaker_failure_threshold": 2,
    "breaker_cool_down_s": 5.0,
    "connect_timeout_s": 1.0,
    "first_byte_timeout_s": 8.0,
    "request_timeout_s": REQUEST_TIMEOUT_S,
    "health_check_interval_s": 0.5,
    "metrics_scrape_interval_s": 1.0,
}


def run(context: DrillContext) -> DrillResult:
    result = DrillResult("fleet_faults")
    storage = Storage(context.work_dir / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, context.model_dir, "fp16"))
    config = {
        "serve": {"engine": ENGINE, "grace_period_s": 10},
        "gateway": {"routing": {"policy": "round_robin"}, "resilience": RESILIENCE},
        "autoscale": {"min_replicas": 2, "max_replicas": 2, "restart_backoff_s": 0.5,
                      "tick_s": 0.25, "max_unresponsive_s": MAX_UNRESPONSIVE_S},
    }  # fmt: skip
    (context.work_dir / "up").mkdir(exist_ok=True)
    up = UpProcess(config, storage.root, SLUG, context.work_dir / "up")
    try:
        up.wait_ready(timeout_s=240)
        up.wait_for(lambda: _num_ready(up) == 2, 240, "two ready replicas")
        _kill_replica(up, context, result)
        _stop_replica(up, context, result)
        if not context.quick:
            _hung_for_good(up, result)
    finally:
        code = up.stop()
    result.check("modelship up stops cleanly", code == 0, f"exit {code}")
    num_replicas = 1 if context.quick else 2
    replicas = [_serve(context, i) for i in range(num_replicas)]
    try:
        for replica in replicas:
            replica.wait_ready(240)
        modes = ["mixed"] if context.quick else ["500", "garbage"]
        for mode in modes:
            _bad_replica(context, replicas[0], mode, result)
        _gateway_restart(context, replicas, "kill", result)
        if not context.quick:
            _gateway_restart(context, replicas, "term", result)
    finally:
        for replica in replicas:
            replica.stop()
    return result


# Helpers -----------------------------------------------------------------------------------
def _num_ready(up: UpProcess, state: str = "ready") -> float:
    return up.metric("modelship_gateway_replicas", track="stable", state=state)


def _wait_replaced(
    up: UpProcess,
    victim: psutil.Process,
    others: set[int],
    since: float,
    timeout_s: float,
    interval_s: float,
) -> float | None:
    """Seconds from `since` until `victim` is gone, exactly one new replica stands beside
    `others` and two are ready; None if that does not happen within `timeout_s`."""

    def replaced() -> bool:
        pids = {r.pid for r in up.replicas()}
        return victim.pid not in pids and len(pids - others) == 1 and _num_ready(up) == 2

    if wait_until(replaced, timeout_s, interval_s):
        return time.monotonic() - since
    return None


def _busy_replica(up: UpProcess) -> psutil.Process:
    """A replica running requests now (the fault then hits work in flight)."""
    deadline = time.monotonic() + 20
    replicas = up.replicas()
    while time.monotonic() < deadline:
        for replica in up.replicas():
            url = up.replica_url(replica)
            try:
                if metric(url, "modelship:num_requests_running") > 0:
                    return replica
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    return replicas[0]


def _serve(context: DrillContext, index: int) -> ReplicaProcess:
    return ReplicaProcess(
        context.model_dir,
        "--served-model-name", SLUG,
        "--max-model-len", str(ENGINE["max_model_len"]),
        "--kv-cache-memory-mb", str(ENGINE["kv_cache_memory_mb"]),
        log_path=context.work_dir / f"replica-{index}.log",
    )  # fmt: skip


class GatewayProcess:
    """`modelship gateway` in front of replicas given by address, on a fixed port (a
    restart comes back on the same one); `close` stops it for good."""

    def __init__(self, config: dict, endpoints: list[str], work_dir: Path) -> None:
        # The port stays bound here (not listening) until close(): the gateway binds it beside
        # this socket (both SO_REUSEADDR), and no other process (a test in another pytest-xdist
        # worker) takes it before the first start or between a stop and the restart.
        self._port_hold = bind_socket("127.0.0.1")
        port = self._port_hold.getsockname()[1]
        self.config_path = work_dir / "gateway.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.command = [sys.executable, "-m", "modelship", "gateway",
                        "--config", str(self.config_path), "--port", str(port),
                        *(arg for url in endpoints for arg in ("--endpoint", url))]  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = work_dir / "gateway.log"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        def ready() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"modelship gateway exited: {self.log_tail()}")
            return httpx.get(f"{self.url}/ready", timeout=1).status_code == 200

        return wait_until(ready, timeout_s, 0.05)

    def log_tail(self, num_chars: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def stop(self) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def close(self) -> int:
        code = self.stop()
        self._port_hold.close()
        return code


def _gateway_config(resilience: dict | None = None) -> dict:
    resilience = {**RESILIENCE, **(resilience or {})}
    return {
        "serve": {"grace_period_s": 10},
        "gateway": {"routing": {"policy": "round_robin"}, "resilience": resilience},
    }


def _record(result: DrillResult, case: str, outcomes: list[Outcome]) -> None:
    counts = tally(outcomes)
    result.figures[f"{case}_sent"] = counts["sent"]
    result.figures[f"{case}_ok"] = counts["ok"]
    result.figures[f"{case}_failed"] = counts["failed"]


def _no_hang(result: DrillResult, case: str, outcomes: list[Outcome]) -> None:
    slowest = max((o.seconds for o in outcomes), default=0.0)
    hung = [o for o in outcomes if o.error == "timeout"]
    result.check(
        f"{case}: no request outlives the request timeout",
        not hung and slowest <= REQUEST_TIMEOUT_S + 5,
        f"slowest {slowest:.1f}s (timeout {REQUEST_TIMEOUT_S:.0f}s); {describe(hung)}",
    )


def _streams_end_visibly(result: DrillResult, case: str, outcomes: list[Outcome]) -> None:
    """A stream either completes or the client sees an error: never cut short silently."""
    silent = [o for o in outcomes if o.stream and o.error in ("truncated", "invalid")]
    result.check(
        f"{case}: every stream completes or ends with an error", not silent, describe(silent)
    )


# Cases -------------------------------------------------------------------------------------
def _kill_replica(up: UpProcess, context: DrillContext, result: DrillResult) -> None:
    case = "kill"
    traffic = Traffic(up.url, SLUG, NUM_CLIENTS, MAX_TOKENS, CLIENT_TIMEOUT_S, user_prefix="k")
    traffic.start()
    replaced_s = None
    try:
        traffic.wait_ok(8, 120)
        victim = _busy_replica(up)
        others = {r.pid for r in up.replicas()} - {victim.pid}
        killed_at = time.monotonic()
        victim.kill()
        replaced_s = _wait_replaced(up, victim, others, killed_at, 180, 0.1)
        replaced_at = time.monotonic()
        traffic.wait_ok(8 if context.quick else 40, 120)
    finally:
        outcomes = traffic.stop()
    retried = up.metric("modelship_gateway_retries_total")
    _record(result, case, outcomes)
    result.figures["time_to_replace_killed_s"] = replaced_s and round(replaced_s, 1)
    result.figures["kill_retried_elsewhere"] = retried
    whole = [o for o in outcomes if not o.stream]
    failed_whole = [o for o in whole if not o.ok]
    result.check(
        "kill: every non-streaming request succeeds",
        whole and not failed_whole,
        describe(failed_whole),
    )
    _streams_end_visibly(result, case, outcomes)
    _no_hang(result, case, outcomes)
    result.check(
        "kill: the fleet replaces the killed replica",
        replaced_s is not None,
        f"restarts {up.metric('modelship_gateway_replica_restarts_total')}",
    )
    after = [o for o in outcomes if o.started >= replaced_at]
    result.check(
        "kill: every request after the replacement succeeds",
        after and all(o.ok for o in after),
        describe(after),
    )


def _stop_replica(up: UpProcess, context: DrillContext, result: DrillResult) -> None:
    case = "hang"
    hold_s = 8.0 if context.quick else MAX_UNRESPONSIVE_S - 5
    traffic = Traffic(up.url, SLUG, NUM_CLIENTS, MAX_TOKENS, CLIENT_TIMEOUT_S, user_prefix="s")
    traffic.start()
    route_around_s = None
    victim = None
    try:
        traffic.wait_ok(8, 120)
        victim = _busy_replica(up)
        victim_url = up.replica_url(victim)
        served_before = metric(victim_url, "modelship:request_success_total")
        stopped_at = time.monotonic()
        victim.suspend()  # SIGSTOP: alive, listening, silent
        if wait_until(lambda: _num_ready(up, "unhealthy") == 1, hold_s, 0.05):
            route_around_s = time.monotonic() - stopped_at
        routed_around_at = time.monotonic()
        time.sleep(max(0.0, stopped_at + hold_s - time.monotonic()))
        victim.resume()
        back = wait_until(lambda: _num_ready(up, "unhealthy") == 0, 60)
        # It takes requests again (round robin: about half of them).
        serves_again = wait_until(
            lambda: metric(victim_url, "modelship:request_success_total") > served_before + 2, 60
        )
    finally:
        if victim is not None and victim.is_running():
            victim.resume()
        outcomes = traffic.stop()
    _record(result, case, outcomes)
    result.figures["time_to_route_around_hung_s"] = route_around_s and round(route_around_s, 2)
    # Attempts abandoned on the hung replica and answered by the other one.
    result.figures["hang_retried_elsewhere"] = up.metric(
        "modelship_gateway_retries_total", kind="unresponsive"
    )
    result.check(
        "hang: the hung replica is routed around",
        route_around_s is not None,
        f"no replica reported unhealthy within {hold_s:.0f}s",
    )
    whole = [o for o in outcomes if not o.stream]
    failed_whole = [o for o in whole if not o.ok]
    result.check(
        "hang: every non-streaming request succeeds",
        whole and not failed_whole,
        describe(failed_whole),
    )
    _streams_end_visibly(result, case, outcomes)
    _no_hang(result, case, outcomes)
    later = [o for o in outcomes if o.started >= routed_around_at]
    result.check(
        "hang: every request after routing around it succeeds",
        later and all(o.ok for o in later),
        describe(later),
    )
    result.check(
        "hang: once resumed it serves again, not replaced",
        back and serves_again and victim.is_running(),
        f"healthy again {back}, serves {serves_again}",
    )


def _bad_replica(
    context: DrillContext, good: ReplicaProcess, mode: str, result: DrillResult
) -> None:
    case = f"bad_{mode}"
    bad = BadReplica(mode)
    work_dir = context.work_dir / case
    work_dir.mkdir(exist_ok=True)
    # A long cool-down: once open, the breaker stays open for the whole case.
    config = _gateway_config({"breaker_cool_down_s": 120.0})
    gateway = GatewayProcess(config, [good.url, bad.url], work_dir)
    try:
        if not result.check(
            f"{case}: the gateway starts", gateway.wait_ready(60), gateway.log_tail()
        ):
            return
        traffic = Traffic(gateway.url, SLUG, NUM_CLIENTS, MAX_TOKENS, CLIENT_TIMEOUT_S)
        traffic.start()
        try:
            traffic.wait_ok(16 if context.quick else 60, 120)
        finally:
            outcomes = traffic.stop()
        opened = metric(gateway.url, "modelship_gateway_breaker_opened_total", endpoint="stable-1")
        opened_good = metric(
            gateway.url, "modelship_gateway_breaker_opened_total", endpoint="stable-0"
        )
        sent_to_bad = bad.num_requests()
    finally:
        gateway.close()
        bad.stop()
    _record(result, case, outcomes)
    result.figures[f"{case}_reached_bad_replica"] = sent_to_bad
    result.check(
        f"{case}: clients see only successes",
        outcomes and all(o.ok for o in outcomes),
        describe(outcomes),
    )
    result.check(
        f"{case}: the bad replica's breaker opens, the good one's never",
        opened >= 1 and opened_good == 0,
        f"opened {opened}, good {opened_good}",
    )
    most = RESILIENCE["breaker_failure_threshold"] + NUM_CLIENTS
    result.check(
        f"{case}: the bad replica gets at most {most} requests",
        sent_to_bad <= most,
        f"{sent_to_bad} of {len(outcomes)}",
    )


def _gateway_restart(
    context: DrillContext, replicas: list[ReplicaProcess], how: str, result: DrillResult
) -> None:
    """`kill`: kill -9 then start again; `term`: SIGTERM (it drains), then start again."""
    case = f"gateway_{how}"
    work_dir = context.work_dir / case
    work_dir.mkdir(exist_ok=True)
    gateway = GatewayProcess(_gateway_config(), [r.url for r in replicas], work_dir)
    down_at = ready_at = None
    try:
        if not result.check(
            f"{case}: the gateway starts", gateway.wait_ready(60), gateway.log_tail()
        ):
            return
        traffic = Traffic(gateway.url, SLUG, NUM_CLIENTS, MAX_TOKENS, CLIENT_TIMEOUT_S)
        traffic.start()
        try:
            traffic.wait_ok(8, 120)
            down_at = time.monotonic()
            if how == "kill":
                gateway.signal(signal.SIGKILL)
                gateway.process.wait()
            else:
                gateway.stop()  # drains: in-flight requests finish first
            gateway.start()
            started = gateway.wait_ready(60)
            ready_at = time.monotonic()
            traffic.wait_ok(8 if context.quick else 40, 120)
        finally:
            outcomes = traffic.stop()
    finally:
        code = gateway.close()
    _record(result, case, outcomes)
    result.figures[f"{case}_down_s"] = ready_at and down_at and round(ready_at - down_at, 1)
    if down_at is not None:
        failed = [o for o in outcomes if not o.ok]
        # Most failures are connections refused while it was down.
        result.figures[f"{case}_in_flight_failed"] = sum(o.started < down_at for o in failed)
    result.check(
        f"{case}: the gateway comes back",
        started and code == 0,
        f"exit {code}: {gateway.log_tail()}",
    )
    failed = [o for o in outcomes if not o.ok]
    # kill -9: what was in flight or sent while it was down sees a connection error;
    # SIGTERM: in-flight requests finish, and what comes while it drains is refused (503).
    expected = {"connection"} if how == "kill" else {"connection", "status"}
    odd = [o for o in failed if o.error not in expected or (how == "term" and o.ended < down_at)]
    result.check(f"{case}: failures are only connection errors ({how})", not odd, describe(odd))
    if how == "term":
        # Requests arriving once it drains are refused (503, Retry-After); none it took is cut.
        cut = [o for o in failed if o.started < down_at and o.error != "status"]
        result.check(f"{case}: no request in flight is cut", not cut, describe(cut))
    after = [o for o in outcomes if o.started >= ready_at]
    result.check(
        f"{case}: every request after the restart succeeds",
        after and all(o.ok for o in after),
        describe(after),
    )
    _no_hang(result, case, outcomes)
    # The replicas kept serving and dropped the work nobody waits for any more.
    alive = all(not r.has_exited() for r in replicas)
    idle = wait_until(
        lambda: all(metric(r.url, "modelship:num_requests_running") == 0 for r in replicas), 30
    )
    result.check(
        f"{case}: replicas keep running, abandoned work cancelled",
        alive and idle,
        f"alive {alive}, idle {idle}",
    )


def _hung_for_good(up: UpProcess, result: DrillResult) -> None:
    """SIGSTOP held past `max_unresponsive_s`: the fleet kills and replaces the replica."""
    case = "hung_for_good"
    traffic = Traffic(up.url, SLUG, NUM_CLIENTS, MAX_TOKENS, CLIENT_TIMEOUT_S, user_prefix="h")
    traffic.start()
    replaced_s = None
    try:
        traffic.wait_ok(8, 120)
        victim = _busy_replica(up)
        others = {r.pid for r in up.replicas()} - {victim.pid}
        stopped_at = time.monotonic()
        victim.suspend()
        replaced_s = _wait_replaced(up, victim, others, stopped_at, MAX_UNRESPONSIVE_S + 120, 0.2)
        traffic.wait_ok(20, 120)
    finally:
        outcomes = traffic.stop()
    _record(result, case, outcomes)
    result.figures["time_to_replace_hung_s"] = replaced_s and round(replaced_s, 1)
    result.check(
        f"{case}: replaced after {MAX_UNRESPONSIVE_S:.0f}s of silence",
        replaced_s is not None and replaced_s >= MAX_UNRESPONSIVE_S,
        f"replaced after {replaced_s}s",
    )
    whole = [o for o in outcomes if not o.stream]
    result.check(
        f"{case}: every non-streaming request succeeds",
        whole and all(o.ok for o in whole),
        describe([o for o in whole if not o.ok]),
    )
    _streams_end_visibly(result, case, outcomes)
    _no_hang(result, case, outcomes)
