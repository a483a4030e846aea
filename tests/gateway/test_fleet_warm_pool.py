"""The warm pool through `modelship up`: a burst is met by a replica already started and
loaded, taken into routing in a supervisor tick, with no model load on the request path.

The routed replica is stopped (SIGSTOP) so the burst stays in flight on it, exactly: the
autoscaler then wants a second replica, and the request sent next must be answered by
the warm one while the first is still stopped, before any new replica could have started.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from modelship.storage import Storage

from fleet_process import UpProcess
from fleet_storage import publish_release

SLUG = "tiny"
SCALE_OUT = "modelship_gateway_scale_out_seconds_count"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    workdir = tmp_path_factory.mktemp("warm")
    storage = Storage(workdir / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, tiny_llama_dir, "fp16"))
    config = {
        "serve": {"engine": {"max_model_len": 256, "kv_cache_memory_mb": 16}},
        "gateway": {
            "routing": {"policy": "least_outstanding_tokens"},
            # no health check finds the stopped replica out during the test
            "resilience": {"health_check_interval_s": 600, "metrics_scrape_interval_s": 600},
            "drift_probe": {"enabled": False},
        },
        "autoscale": {
            "min_replicas": 1, "max_replicas": 2, "warm_pool": 1, "target_concurrency": 2,
            "scale_up_window_s": 0.5, "scale_down_window_s": 600, "anticipate": False,
            "max_unresponsive_s": 600, "tick_s": 0.25,
        },
    }  # fmt: skip
    with UpProcess(config, storage.root, SLUG, workdir).running() as up:
        yield up


def replicas_in(up: UpProcess, state: str) -> float:
    return up.metric("modelship_gateway_replicas", state=state)


def ask(up: UpProcess, text: str):
    c = openai.OpenAI(base_url=f"{up.url}/v1", api_key="none", max_retries=0, timeout=120)
    return c.chat.completions.create(
        model=SLUG, messages=[{"role": "user", "content": text}], max_tokens=4
    )


def served_requests(replica: psutil.Process) -> float:
    text = httpx.get(f"{UpProcess.replica_url(replica)}/metrics", timeout=5).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("modelship:request_success_total")
    )


def test_a_burst_takes_the_warm_replica_into_routing_with_no_cold_start(fleet: UpProcess):
    fleet.wait_for(
        lambda: replicas_in(fleet, "ready") == 1 and replicas_in(fleet, "standby") == 1,
        120,
        "one replica routed and one in the warm pool",
    )
    assert ask(fleet, "which one is routed?").choices
    replicas = fleet.replicas()
    routed = [r for r in replicas if served_requests(r) > 0]
    assert len(routed) == 1 and len(replicas) == 2
    warm = next(r for r in replicas if r is not routed[0])
    ready_before = fleet.metric("modelship_gateway_replica_time_to_ready_seconds_count")
    cold_before = fleet.metric(SCALE_OUT, source="cold")  # the fleet's first replica

    routed[0].send_signal(signal.SIGSTOP)
    answers: list = []
    burst = [
        threading.Thread(target=lambda: answers.append(ask(fleet, "burst")), daemon=True)
        for _ in range(4)
    ]
    try:
        for thread in burst:
            thread.start()
        # 4 in flight for a target of 2 per replica: the warm replica is routed
        fleet.wait_for(lambda: fleet.metric(SCALE_OUT, source="warm") == 1, 30, "a warm scale-out")
        # ... and answers while the first replica is still stopped: capacity at once
        assert ask(fleet, "after the burst").choices
        assert served_requests(warm) >= 1
        # no replica became ready in between: no cold start served it
        ready_after = fleet.metric("modelship_gateway_replica_time_to_ready_seconds_count")
        assert ready_after == ready_before
        assert fleet.metric(SCALE_OUT, source="cold") == cold_before
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            routed[0].send_signal(signal.SIGCONT)
    for thread in burst:
        thread.join(timeout=60)
    assert len(answers) == 4
    # a new replica refills the warm pool
    fleet.wait_for(lambda: replicas_in(fleet, "standby") == 1, 120, "the warm pool refilled")
