"""Canary releases through `modelship up`: a sticky split, promotion, and the automatic
rollback of a canary much slower than stable. Real replicas of tiny models; the release
plan is changed with the real `modelship release` CLI, as an operator would."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from modelship.release import golden
from modelship.storage import Storage

from fleet_process import UpProcess
from fleet_storage import publish_release
from tiny_models import make_tiny_llama

SLUG = "tiny"
# about 2 minutes in CI: handed to a worker first (tests/conftest.py)
pytestmark = [pytest.mark.timeout(300), pytest.mark.long]


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    workdir = tmp_path_factory.mktemp("canary")
    storage = Storage(workdir / "storage")
    publish_release(storage, SLUG, tiny_llama_dir, "fp16")  # 1: production
    publish_release(storage, SLUG, make_tiny_llama(workdir / "next", seed=1), "gptq")  # 2
    # 3: a much bigger model under the same tokenizer: a release that regressed on latency.
    slow = make_tiny_llama(
        workdir / "slow", seed=2, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4,
    )  # fmt: skip
    publish_release(storage, SLUG, slow, "awq")
    storage.set_production(SLUG, 1)
    config = {
        "serve": {"engine": {"max_model_len": 512, "kv_cache_memory_mb": 32}},
        "gateway": {
            "canary": {
                # More than the sticky test sends the canary (~25 of its ~95 requests): a
                # one-off stall on a busy machine must not roll that canary back mid-test.
                "min_requests": 40,
                "window_s": 120,
                "max_ttft_p95_ratio": 2.0,
                "min_ttft_increase_s": 0.1,
            },
        },
        "autoscale": {"min_replicas": 1, "max_replicas": 1, "tick_s": 0.25},
    }
    with UpProcess(config, storage.root, SLUG, workdir).running() as up:
        yield up


def release_of(
    fleet: UpProcess, user: str, prompt: str = "hello there", max_tokens: int = 2,
    stream: bool = False,
) -> str:  # fmt: skip
    body = {"model": SLUG, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "user": user, "stream": stream}  # fmt: skip
    url = f"{fleet.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        response.read()  # a stream to its end: the judge counts it once it ends
        assert response.status_code == 200, response.text
        return response.headers["x-modelship-release"]


def canary_ready(fleet: UpProcess, weight: int) -> bool:
    ready = fleet.metric("modelship_gateway_replicas", track="canary", state="ready")
    return ready == 1 and fleet.metric("modelship_gateway_canary_weight") == weight


def test_canary_split_is_sticky_then_promote(fleet: UpProcess):
    result = fleet.cli("release", "canary", "--release", "2", "--weight", "30")
    assert result.returncode == 0, result.stderr
    fleet.wait_for(lambda: canary_ready(fleet, 30), 120, "the canary replica")

    users = [f"user-{i}" for i in range(60)]
    first = {user: release_of(fleet, user) for user in users}
    counts = Counter(first.values())
    assert set(counts) == {"1", "2"}
    assert 6 <= counts["2"] <= 32, counts  # 30% of 60, with room for chance
    assert all(release_of(fleet, user) == first[user] for user in users[:15])  # sticky

    result = fleet.cli("release", "promote")
    assert result.returncode == 0, result.stderr
    assert "release 1 -> release 2" in result.stdout
    # The canary's replica becomes stable; release 1's replica is drained and stops.
    fleet.wait_for(
        lambda: (
            fleet.metric("modelship_gateway_replicas", release="1") == 0
            and len(fleet.replicas()) == 1
        ),
        60,
        "release 1 to be drained",
    )
    assert {release_of(fleet, user) for user in users[:20]} == {"2"}
    assert fleet.metric("modelship_gateway_replica_time_to_ready_seconds_count") == 2


def test_slow_canary_is_rolled_back_automatically(fleet: UpProcess):
    result = fleet.cli("release", "canary", "--release", "3", "--weight", "50")
    assert result.returncode == 0, result.stderr
    fleet.wait_for(lambda: canary_ready(fleet, 50), 120, "the slow canary replica")

    prompt = "Tell me about paged attention and continuous batching. " * 12
    answered: list[str] = []
    rolled_back = threading.Event()

    def worker(worker_id: int) -> None:
        for i in range(40):
            if rolled_back.is_set():
                return
            # Streams: the judge compares first-token times, which only streams show.
            answered.append(release_of(fleet, f"w{worker_id}-{i}", prompt, stream=True))

    def watch() -> bool:
        if fleet.metric("modelship_gateway_canary_rollbacks_total") >= 1:
            rolled_back.set()
        return rolled_back.is_set()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        fleet.wait_for(watch, 240, "the automatic rollback")
    finally:
        rolled_back.set()
        for thread in threads:
            thread.join(timeout=120)
    assert "3" in answered  # the canary did take traffic before it was judged

    plan = json.loads((fleet.storage / "models" / SLUG / "traffic.json").read_text())
    assert plan["canary"] is None
    event = plan["events"][-1]
    assert event["action"] == "auto_rollback" and event["release"] == 3
    assert "TTFT" in event["reason"]
    status = fleet.cli("release", "status")
    assert "canary: none" in status.stdout and "auto_rollback release 3" in status.stdout
    # Everything goes to production again, and the canary replica is drained.
    assert {release_of(fleet, f"after-{i}") for i in range(10)} == {"2"}
    fleet.wait_for(lambda: len(fleet.replicas()) == 1, 60, "the canary replica to stop")


def test_release_cli_errors(fleet: UpProcess):
    result = fleet.cli("release", "canary", "--release", "9", "--weight", "10")
    assert result.returncode == 1
    assert "release 9 does not exist" in result.stderr
    result = fleet.cli("release", "rollback")
    assert result.returncode == 1 and "no canary is running" in result.stderr

    shown = fleet.cli("release", "show", "3", "--json")
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert record["production"] is False and record["canary"] is None
    actions = [(e["action"], e.get("weight")) for e in record["history"]]
    assert actions == [("canary", 50), ("auto_rollback", None)]
    assert all("@" in e["by"] for e in record["history"])  # who: user@host


def copy_with_golden(source: Path, target: Path, answers: list, noise: float = 0.0) -> Path:
    """`source`'s files in a new folder with `golden.json`; with `noise`, every weight is
    perturbed: the weights changed on disk after select recorded the golden answers."""
    import torch
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.name not in ("manifest.json", "model.safetensors"):
            shutil.copy(path, target / path.name)
    tensors = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    if noise:
        tensors = {
            name: t + noise * t.float().std() * torch.randn(t.shape, generator=generator)
            for name, t in tensors.items()
        }
    save_file({name: t.contiguous() for name, t in tensors.items()}, target / "model.safetensors")
    golden.write_reference(target / golden.GOLDEN_FILE, answers)
    return target


def test_a_canary_whose_weights_drifted_is_rolled_back(fleet: UpProcess, tmp_path: Path):
    storage = Storage(fleet.storage)
    production = storage.production_release(SLUG)

    async def record() -> list[golden.GoldenAnswer]:
        async with httpx.AsyncClient() as client:
            return await golden.ask_all(client, fleet.url, SLUG)

    answers = asyncio.run(record())  # production's answers, as select would have recorded
    assert all(a.tokens and len(a.tokens) == len(a.logprobs) for a in answers)
    source = storage.release_dir(SLUG, production)
    same = publish_release(
        storage, SLUG, copy_with_golden(source, tmp_path / "same", answers), "fp16"
    )
    altered = copy_with_golden(source, tmp_path / "altered", answers, noise=0.5)
    drifted = publish_release(storage, SLUG, altered, "fp16")

    # The same weights reproduce every golden answer: probed once ready, kept as canary.
    assert fleet.cli("release", "canary", "--release", str(same), "--weight", "10").returncode == 0
    fleet.wait_for(
        lambda: fleet.metric("modelship_gateway_drift_probes_total", release=str(same)) >= 1,
        120,
        "the first drift probe of the canary",
    )
    assert fleet.metric("modelship_gateway_drift_agreement", release=str(same)) == 1.0
    assert fleet.metric("modelship_gateway_drift_alert", release=str(same)) == 0.0
    assert plan(fleet)["canary"] == {"release": same, "weight": 10}
    assert fleet.cli("release", "rollback").returncode == 0

    # Altered weights: caught by the probe and rolled back, with no request sent to it.
    canary = fleet.cli("release", "canary", "--release", str(drifted), "--weight", "10")
    assert canary.returncode == 0, canary.stderr
    fleet.wait_for(lambda: plan(fleet)["canary"] is None, 120, "the drift rollback")
    event = plan(fleet)["events"][-1]
    assert event["action"] == "auto_rollback" and event["release"] == drifted
    assert "quality drift" in event["reason"]
    outcome = {"release": str(drifted), "outcome": "drift"}
    assert fleet.metric("modelship_gateway_drift_probes_total", **outcome) >= 1


def plan(fleet: UpProcess) -> dict:
    return json.loads((fleet.storage / "models" / SLUG / "traffic.json").read_text())
