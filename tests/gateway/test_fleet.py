"""`modelship up` end to end: a real gateway over real replica processes of a tiny model,
driven through the openai SDK."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelship.deploy.dashboard import dashboard, queried_metrics
from modelship.gateway import hash_api_key
from modelship.storage import Storage

from fleet_process import UpProcess
from fleet_storage import publish_release
from tiny_models import make_tiny_lora

SLUG = "tiny"
KEY = "sk-alpha-test"
LIMITED_KEY = "sk-limited-test"
BILLING_KEY = "sk-billing-test"
OPEN_KEY = "sk-open-test"  # a tenant with no allow lists
ADMIN_KEY = "sk-admin-test"  # may load and unload adapters on every replica
PRICE = {"input_per_1k": 0.5, "output_per_1k": 2.0}
ADAPTER = "tiny-attn"  # a LoRA adapter every replica serves
METRICS_KEY = "sk-metrics-test"

pytestmark = pytest.mark.timeout(300)


def fleet_config() -> dict:
    return {
        "serve": {"engine": {"max_model_len": 256, "kv_cache_memory_mb": 16}},
        "gateway": {
            "tenants": [
                {
                    "name": "alpha",
                    "api_key_sha256": hash_api_key(KEY),
                    "priority": "high",
                    "allowed_adapters": [ADAPTER],  # private to alpha
                },
                {"name": "open", "api_key_sha256": hash_api_key(OPEN_KEY)},
                {
                    "name": "limited",
                    "api_key_sha256": [hash_api_key(LIMITED_KEY)],
                    "requests_per_minute": 2,
                    "max_output_tokens": 16,
                    "allowed_models": [SLUG],
                },
                {
                    "name": "billing",
                    "api_key_sha256": hash_api_key(BILLING_KEY),
                    "allowed_models": [SLUG],
                },
            ],
            "cost": {"variants": {"fp16": PRICE}},
            "routing": {"policy": "least_outstanding_tokens"},
            "metrics_api_key_sha256": hash_api_key(METRICS_KEY),
            "admin_api_key_sha256": hash_api_key(ADMIN_KEY),
            "resilience": {"breaker_failure_threshold": 1, "breaker_cool_down_s": 30},
        },
        "autoscale": {
            "min_replicas": 1,
            "max_replicas": 2,
            "target_concurrency": 2,
            "scale_up_window_s": 0.5,
            "scale_down_window_s": 3,
            "restart_backoff_s": 0.5,
            "tick_s": 0.25,
        },
    }


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    workdir = tmp_path_factory.mktemp("fleet")
    storage = Storage(workdir / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, tiny_llama_dir, "fp16"))
    adapter = make_tiny_lora(tiny_llama_dir, workdir / "adapter", 4, ["q_proj", "v_proj"])
    config = fleet_config()
    config["serve"]["loras"] = {ADAPTER: str(adapter)}
    make_tiny_lora(tiny_llama_dir, workdir / "late", 8, ["o_proj", "up_proj"], seed=7)
    config["gateway"]["adapter_roots"] = [str(workdir)]
    (workdir / "escape").symlink_to(tiny_llama_dir.parent)  # a link out of the root
    up = UpProcess(config, storage.root, SLUG, workdir)
    up.metrics_key = METRICS_KEY
    with up.running():
        yield up


def client(fleet: UpProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=key, max_retries=0, timeout=60)


def ask(c: openai.OpenAI, text: str, max_tokens: int = 8, **kwargs):
    return c.chat.completions.create(
        model=SLUG, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, **kwargs
    )


def test_unknown_or_missing_key_is_401(fleet: UpProcess):
    with pytest.raises(openai.AuthenticationError) as info:
        ask(client(fleet, "sk-wrong"), "hello")
    assert info.value.body["code"] == "invalid_api_key"
    response = httpx.post(f"{fleet.url}/v1/chat/completions", json={"model": SLUG}, timeout=10)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_list_shows_what_up_serves(fleet: UpProcess):
    result = subprocess.run(
        [sys.executable, "-m", "modelship", "list", "--json", "--storage", str(fleet.storage)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    [row] = json.loads(result.stdout)
    assert (row["model"], row["production"], row["production_variant"]) == (SLUG, 1, "fp16")
    assert row["serving"].startswith(f"http://127.0.0.1:{fleet.port}/v1 (pid ")


def test_tenant_limits(fleet: UpProcess):
    limited = client(fleet, LIMITED_KEY)
    with pytest.raises(openai.BadRequestError, match="at most 16"):
        ask(limited, "too long an answer", max_tokens=64)
    with pytest.raises(openai.PermissionDeniedError):
        limited.chat.completions.create(
            model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    ask(limited, "one")
    answer = ask(limited, "two")  # no max_tokens sent: the tenant's cap applies
    assert answer.usage.completion_tokens <= 16
    with pytest.raises(openai.RateLimitError) as info:
        ask(limited, "three")
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert info.value.body["code"] == "requests_per_minute"
    assert (
        fleet.metric(
            "modelship_gateway_rejections_total", tenant="limited", reason="requests_per_minute"
        )
        == 1
    )
    # Another tenant is not affected.
    assert ask(client(fleet), "still fine").choices[0].finish_reason in ("length", "stop")


def test_streaming_through_the_gateway(fleet: UpProcess):
    c = client(fleet)
    whole = ask(c, "stream me", max_tokens=12, temperature=0)
    stream = ask(c, "stream me", max_tokens=12, temperature=0, stream=True)
    chunks = [chunk for chunk in stream]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_response_says_which_variant_answered(fleet: UpProcess):
    response = httpx.post(
        f"{fleet.url}/v1/completions",
        json={"model": SLUG, "prompt": "hello", "max_tokens": 2},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert response.status_code == 200
    assert response.headers["x-modelship-variant"] == "fp16"
    # Which release (canary or stable) only the operator's keys hear.
    assert "x-modelship-release" not in response.headers


class Load:
    """Closed-loop non-streaming load from `concurrency` threads; every failure is kept."""

    def __init__(self, fleet: UpProcess, concurrency: int) -> None:
        self.c = client(fleet)
        self.stop = threading.Event()
        self.num_ok = 0
        self.failures: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrency)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                ask(self.c, f"worker {worker} request {n} " + "x" * (n % 7), max_tokens=24)
                self.num_ok += 1
            except BaseException as exc:
                self.failures.append(exc)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def ready_replicas(fleet: UpProcess) -> float:
    return fleet.metric("modelship_gateway_replicas", track="stable", state="ready")


def busy_replica(fleet: UpProcess) -> psutil.Process:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for replica in fleet.replicas():
            text = httpx.get(f"{fleet.replica_url(replica)}/metrics", timeout=5).text
            if any(
                line.startswith("modelship:num_requests_running") and float(line.split()[-1]) > 0
                for line in text.splitlines()
            ):
                return replica
    raise AssertionError("no replica was running a request")


def test_scale_out_survive_kill_then_scale_in(fleet: UpProcess):
    assert ready_replicas(fleet) == 1
    load = Load(fleet, concurrency=6)
    try:
        # Six in flight against a target of two per replica: a second replica starts.
        fleet.wait_for(lambda: ready_replicas(fleet) == 2, 120, "scale out to 2 replicas")
        assert fleet.metric("modelship_gateway_replica_time_to_ready_seconds_count") >= 2
        before = load.num_ok
        fleet.wait_for(lambda: load.num_ok > before + 10, 60, "traffic on two replicas")

        # kill -9 a replica while it runs requests: they are retried on the other one.
        victim = busy_replica(fleet)
        victim.kill()
        fleet.wait_for(
            lambda: fleet.metric("modelship_gateway_replica_restarts_total") >= 1,
            30,
            "the supervisor to notice the crash",
        )
        fleet.wait_for(lambda: ready_replicas(fleet) == 2, 120, "the replacement to be ready")
        after_restart = load.num_ok
        fleet.wait_for(lambda: load.num_ok > after_restart + 10, 60, "traffic after restart")
    finally:
        load.finish()
    assert not load.failures, f"{len(load.failures)} requests failed: {load.failures[:3]}"
    assert fleet.metric("modelship_gateway_breaker_opened_total") >= 1
    assert fleet.metric("modelship_gateway_retries_total") >= 1

    # Idle for the scale-down window: back to one replica, drained without a failure.
    fleet.wait_for(lambda: ready_replicas(fleet) == 1, 60, "scale in to 1 replica")
    fleet.wait_for(lambda: len(fleet.replicas()) == 1, 60, "the drained replica to exit")
    assert fleet.metric("modelship_gateway_scale_events_total", direction="down") >= 1
    assert ask(client(fleet), "after scale in").choices
    failed = fleet.metric("modelship_gateway_requests_total", tenant="alpha", status="502")
    assert failed == 0


def test_usage_and_cost_add_up(fleet: UpProcess):
    billing = client(fleet, BILLING_KEY)
    used = [ask(billing, f"count to {i}", max_tokens=4 + i).usage for i in range(4)]
    stream = billing.chat.completions.create(
        model=SLUG, messages=[{"role": "user", "content": "stream"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    used += [chunk.usage for chunk in stream if chunk.usage is not None]
    inputs = sum(u.prompt_tokens for u in used)
    outputs = sum(u.completion_tokens for u in used)
    expected = (inputs * PRICE["input_per_1k"] + outputs * PRICE["output_per_1k"]) / 1000

    def billed() -> list[dict]:
        result = fleet.cli("usage", "--since", "1h", "--json")
        assert result.returncode == 0, result.stderr
        return [row for row in json.loads(result.stdout) if row["tenant"] == "billing"]

    fleet.wait_for(lambda: billed() and billed()[0]["requests"] == 5, 30, "the usage ledger")
    [row] = billed()
    assert (row["model"], row["variant"]) == (SLUG, "fp16")
    assert (row["input_tokens"], row["output_tokens"]) == (inputs, outputs)
    assert row["cost"] == pytest.approx(expected) and row["unpriced_requests"] == 0
    assert fleet.metric("modelship_gateway_cost_total", tenant="billing") == pytest.approx(expected)
    output = fleet.metric("modelship_gateway_tokens_total", tenant="billing", kind="output")
    assert output == outputs
    table = fleet.cli("usage", "--since", "1h")
    assert table.returncode == 0 and f"usage of {SLUG} since" in table.stdout
    bad = fleet.cli("usage", "--since", "yesterday")
    assert bad.returncode == 2 and "--since takes a duration" in bad.stderr


def exposed_names(text: str) -> set[str]:
    """Family and sample names of a /metrics page."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def test_every_dashboard_query_reads_a_live_metric(fleet: UpProcess):
    headers = {"authorization": f"Bearer {METRICS_KEY}"}
    exposed = exposed_names(httpx.get(f"{fleet.url}/metrics", headers=headers, timeout=10).text)
    for replica in fleet.replicas():
        exposed |= exposed_names(
            httpx.get(f"{fleet.replica_url(replica)}/metrics", timeout=10).text
        )
    queried = queried_metrics(dashboard())
    assert len(queried) > 20
    missing = {
        name
        for name in queried
        if name not in exposed
        and not any(name.removesuffix(suffix) in exposed for suffix in ("_bucket", "_total"))
    }
    assert not missing, f"panels query series no component exposes: {sorted(missing)}"


def test_an_adapter_is_private_to_the_tenants_allowed_it(fleet: UpProcess):
    listed = {card.id for card in client(fleet).models.list().data}
    assert listed == {SLUG, ADAPTER}
    answer = client(fleet).completions.create(model=ADAPTER, prompt="one two", max_tokens=4)
    assert answer.model == ADAPTER and answer.usage.completion_tokens == 4
    for key in (BILLING_KEY, OPEN_KEY):  # allowed_models: [SLUG]; none, but not alpha
        other = client(fleet, key)
        assert {card.id for card in other.models.list().data} == {SLUG}
        with pytest.raises(openai.PermissionDeniedError, match=ADAPTER):
            other.completions.create(model=ADAPTER, prompt="one two", max_tokens=4)
        assert other.completions.create(model=SLUG, prompt="one", max_tokens=2).model == SLUG


def test_an_admin_loads_and_unloads_an_adapter_on_every_replica(fleet: UpProcess) -> None:
    def admin(action: str, key: str, **body) -> httpx.Response:
        return httpx.post(f"{fleet.url}/v1/{action}_lora_adapter", json=body, timeout=120,
                          headers={"authorization": f"Bearer {key}"})  # fmt: skip

    late = str(fleet.config_path.parent / "late")
    assert admin("load", KEY, lora_name="late", lora_path=late).status_code == 403  # a tenant
    assert admin("load", "sk-nobody", lora_name="late", lora_path=late).status_code == 401
    bad = admin("load", ADMIN_KEY, lora_name="late")
    assert bad.status_code == 400 and "lora_path" in bad.json()["error"]["message"]
    loaded = admin("load", ADMIN_KEY, lora_name="late", lora_path=late)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["replicas"]  # every replica running when it was asked
    assert "late" in {card.id for card in client(fleet).models.list().data}
    answer = client(fleet).completions.create(model="late", prompt="one two", max_tokens=4)
    assert answer.model == "late"
    missing = admin("load", ADMIN_KEY, lora_name="gone", lora_path=late + "-nowhere")
    assert missing.status_code == 400 and "done on 0 of" in missing.json()["error"]["message"]
    # One name, one set of weights: the same folder again changes nothing; another is a
    # conflict (replicas started later would have served it under the same name).
    again = admin("load", ADMIN_KEY, lora_name="late", lora_path=late)
    assert again.status_code == 200, again.text
    assert {r["result"] for r in again.json()["replicas"]} == {"already_loaded"}
    other = str(fleet.config_path.parent / "adapter")
    moved = admin("load", ADMIN_KEY, lora_name="late", lora_path=other)
    assert moved.status_code == 409 and moved.json()["error"]["param"] == "lora_name"
    odd = admin("load", ADMIN_KEY, lora_name="a=b", lora_path=late)  # `--lora a=b=PATH`
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "lora_name"
    linked = str(fleet.config_path.parent / "escape" / "model")
    out = admin("load", ADMIN_KEY, lora_name="out", lora_path=linked)
    assert out.status_code == 403 and out.json()["error"]["param"] == "lora_path"
    assert admin("unload", ADMIN_KEY, lora_name="late").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client(fleet).completions.create(model="late", prompt="one two", max_tokens=4)
    configured = admin("unload", ADMIN_KEY, lora_name=ADAPTER)
    assert configured.status_code == 409  # serve.loras' adapters stay with the config
