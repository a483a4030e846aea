"""`modelship gateway` finding its replicas in the Kubernetes API (`gateway/discovery.py`):
real `modelship serve` processes as the pods of a headless Service, whose EndpointSlices a
stand-in API server (`benchmarks/kube_stand_in.py`) lists and watches. The gateway routes
to a pod once its slice says ready, stops routing to one that leaves or turns not-ready,
survives a dropped watch and a 410, and fails a stream over from a killed pod (the twin
of `test_failover.py`'s, which runs under `modelship up`), and retries the requests of a
killed pod its slice still lists (the kill in `test_fleet.py`'s scale test)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway_process import GatewayProcess
from kube_stand_in import KubeStandIn
from modelship.engine.faults import FAULTS_ENV
from modelship.gateway import hash_api_key
from modelship.gateway.discovery import RELEASE_LABEL

from server_process import ServerProcess

MODEL = "tiny"
SERVICE = "tiny-engine"
KILL_SEED, KILL_AFTER = 7, 8  # a request with this seed kills its replica at its 8th token
# The replicas' key: with it they trust the gateway's resume fields (mid-stream failover);
# a gateway without tenants requires it of its clients too.
KEY = "sk-replica-test"
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path) -> Iterator[list[ServerProcess]]:
    """Two pods' worth of replicas; a request with KILL_SEED kills the one serving it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FAULTS_ENV, f"kill={KILL_SEED}/{KILL_AFTER}")
        args = ["--served-model-name", MODEL, "--max-model-len", "128", "--kv-cache-memory-mb", "8"]
        started = [ServerProcess(tiny_llama_dir, *args, api_key=KEY) for _ in range(2)]
    yield started
    for process in started:
        process.stop()


@pytest.fixture
def kube() -> Iterator[KubeStandIn]:
    stand_in = KubeStandIn().start()
    yield stand_in
    stand_in.stop()


@pytest.fixture
def start_gateway(tmp_path: Path, kube: KubeStandIn) -> Iterator[Callable[[], GatewayProcess]]:
    started: list[GatewayProcess] = []

    def start(**resilience) -> GatewayProcess:
        config = {
            "routing": {"policy": "round_robin"},
            "resilience": {"max_failovers": 1, "breaker_failure_threshold": 5, **resilience},
            "discovery": {"services": [SERVICE], "namespace": kube.namespace},
            "metrics_api_key_sha256": hash_api_key(KEY),
        }
        process = GatewayProcess(tmp_path, config, "--kube-api", kube.url, api_key=KEY)
        process.metrics_key = KEY
        started.append(process)
        process.wait_ready(60)
        return process

    yield start
    for process in started:
        assert process.stop() == 0, process.log_tail()


def put(kube: KubeStandIn, pod: str, replica: ServerProcess, ready: bool = True) -> None:
    """The pod's slice says ready (or not); its release label names the pod, which the
    gateway's `x-modelship-release` header then names for each answer."""
    kube.put_pod(SERVICE, pod, replica.port, ready=ready, labels={RELEASE_LABEL: pod})


def answered_by(gateway: GatewayProcess) -> str:
    response = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 1},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.headers["x-modelship-release"]


def wait_until_answered_only_by(gateway: GatewayProcess, pods: set[str]) -> None:
    """Requests until four in a row were answered by `pods` and, round-robin, by each of
    them (bounded: the watch delivers in well under the 20 s given)."""
    deadline = time.monotonic() + 20
    recent: list[str] = []
    while time.monotonic() < deadline:
        recent = [*recent, answered_by(gateway)][-4:]
        if len(recent) == 4 and set(recent) == pods:
            return
        time.sleep(0.05)
    raise AssertionError(f"still answered by {recent}, expected only {pods}")


def test_the_gateway_routes_to_the_pods_its_slices_say_are_ready(
    replicas: list[ServerProcess], kube: KubeStandIn, start_gateway
):
    put(kube, "pod-a", replicas[0])
    put(kube, "pod-b", replicas[1], ready=False)  # starting: its slice says not ready
    gateway = start_gateway()
    assert {answered_by(gateway) for _ in range(4)} == {"pod-a"}
    seen = {"model": "primary", "track": "stable", "tier": "primary"}
    assert gateway.metric("modelship_gateway_discovered_endpoints", **seen) == 1

    put(kube, "pod-b", replicas[1])  # ready now
    wait_until_answered_only_by(gateway, {"pod-a", "pod-b"})
    assert gateway.metric("modelship_gateway_discovered_endpoints", **seen) == 2

    kube.remove_pod(SERVICE, "pod-a")  # scaled in: its slice deleted
    wait_until_answered_only_by(gateway, {"pod-b"})

    put(kube, "pod-a", replicas[0])  # back
    put(kube, "pod-b", replicas[1], ready=False)  # terminating
    wait_until_answered_only_by(gateway, {"pod-a"})
    assert gateway.metric("modelship_gateway_breaker_state", endpoint="pod-a") == 1  # routed
    assert gateway.metric("modelship_gateway_breaker_state", endpoint="pod-b") == 0  # removed
    assert kube.num_lists == 1  # one list, then one watch followed every change


def test_discovery_survives_a_dropped_watch_and_a_410(
    replicas: list[ServerProcess], kube: KubeStandIn, start_gateway
):
    put(kube, "pod-a", replicas[0])
    gateway = start_gateway()
    watches = kube.num_watches

    kube.drop_watches()  # the connection ends: the watch resumes from its last version
    put(kube, "pod-b", replicas[1])
    wait_until_answered_only_by(gateway, {"pod-a", "pod-b"})
    assert kube.num_watches > watches
    assert kube.num_lists == 1
    assert kube.watch_params[-1]["resourceVersion"] != ["0"]

    kube.expire_watches()  # 410 Gone: the history is compacted, the gateway lists again
    kube.remove_pod(SERVICE, "pod-b")
    wait_until_answered_only_by(gateway, {"pod-a"})
    assert kube.num_lists == 2
    # The gateway's own count of it, on its /metrics.
    assert gateway.metric("modelship_gateway_discovery_lists_total") == 2
    assert gateway.metric("modelship_gateway_discovery_watch_ends_total", reason="expired") == 1
    assert gateway.metric("modelship_gateway_discovered_endpoints") == 1


def _chat(gateway: GatewayProcess, **kwargs) -> tuple[str, openai.types.CompletionUsage]:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0,
                           timeout=60)  # fmt: skip
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "The quick brown fox"}],
        max_tokens=KILL_AFTER,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        **kwargs,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len({c.id for c in chunks}) == 1  # one stream, whichever pod served it
    return text, chunks[-1].usage


def test_a_chat_stream_survives_a_killed_pod(
    replicas: list[ServerProcess], kube: KubeStandIn, start_gateway
):
    """`test_failover.py::test_chat_stream_survives_a_killed_replica` with discovered pods
    (last in this module: it kills a replica)."""
    put(kube, "pod-a", replicas[0])
    put(kube, "pod-b", replicas[1])
    gateway = start_gateway()
    wait_until_answered_only_by(gateway, {"pod-a", "pod-b"})
    resumed_before = gateway.metric("modelship_gateway_failovers_total", outcome="resumed")
    expected, expected_usage = _chat(gateway)
    text, usage = _chat(gateway, seed=KILL_SEED)  # its first pod dies mid-stream
    assert text == expected
    assert usage == expected_usage  # counted as one uninterrupted stream
    after = gateway.metric("modelship_gateway_failovers_total", outcome="resumed")
    assert after == resumed_before + 1
    assert sum(replica.has_exited() for replica in replicas) == 1


def test_requests_survive_a_killed_pod_its_slice_still_lists(
    replicas: list[ServerProcess], kube: KubeStandIn, start_gateway
):
    """The kill of `test_fleet.py::test_scale_out_survive_kill_then_scale_in` with discovered
    pods: Kubernetes lists a killed pod as ready until its probe fails; meanwhile the
    gateway retries its requests on another pod and opens its breaker. (After the stream
    test a replica is dead already; run alone, this test kills one.)"""
    if not any(replica.has_exited() for replica in replicas):
        replicas[1].kill()
        replicas[1].process.wait(timeout=30)
    survivor = next(replica for replica in replicas if not replica.has_exited())
    victim = next(replica for replica in replicas if replica.has_exited())
    put(kube, "pod-a", survivor)
    put(kube, "pod-b", victim)  # still listed ready
    # Health checks far apart: only the request path finds the dead pod.
    gateway = start_gateway(health_check_interval_s=60)
    answers = [answered_by(gateway) for _ in range(12)]
    assert set(answers) == {"pod-a"}  # every request answered, by the live pod
    assert gateway.metric("modelship_gateway_retries_total") >= 1
    assert gateway.metric("modelship_gateway_breaker_opened_total") >= 1

    kube.remove_pod(SERVICE, "pod-b")  # its probe failed at last: out of the slice
    deadline = time.monotonic() + 20
    while gateway.metric("modelship_gateway_breaker_state", endpoint="pod-b") > 0:
        assert time.monotonic() < deadline, "pod-b is still in the gateway's pool"
        time.sleep(0.1)
