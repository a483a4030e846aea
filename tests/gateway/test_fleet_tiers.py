"""Precision tiers through `modelship up`: a primary release and a cheaper tier, each with a
real replica; brown-out under overload before any refusal, an opted-out tenant kept on the
primary, tier rules and a client naming its tier.

Load is made exact by stopping the replicas (SIGSTOP): a request sent to a stopped replica
stays in flight (the kernel accepts the connection; nobody answers), so the test decides
how many each tier holds, sends the next request, and reads the decision from the
gateway's metrics before going on. SIGCONT lets every held request finish.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from modelship.gateway import hash_api_key
from modelship.storage import Storage

from fleet_process import UpProcess
from fleet_storage import publish_release, publish_variant

SLUG = "tiny"
BATCH_KEY = "sk-batch-test"  # low priority, may be degraded
VIP_KEY = "sk-vip-test"  # normal priority, allow_degraded: false
METRICS_KEY = "sk-metrics-test"  # the series that move per request need it
DECISIONS = "modelship_gateway_tier_decisions_total"

pytestmark = pytest.mark.timeout(300)


def tiers_config() -> dict:
    quiet = {"health_check_interval_s": 600, "metrics_scrape_interval_s": 600}
    return {
        "serve": {"engine": {"max_model_len": 256, "kv_cache_memory_mb": 16}},
        "gateway": {
            "tenants": [
                {"name": "batch", "api_key_sha256": hash_api_key(BATCH_KEY), "priority": "low"},
                {"name": "vip", "api_key_sha256": hash_api_key(VIP_KEY), "allow_degraded": False},
            ],
            "metrics_api_key_sha256": hash_api_key(METRICS_KEY),
            "tiers": [{"name": "economy", "variant": "int4", "min_replicas": 1}],
            "tier_rules": [
                {"name": "short", "tier": "economy", "max_output_tokens": 4, "priorities": ["low"]}
            ],
            "brownout": {"max_in_flight_per_replica": 2},
            # 5 requests held at most when a low-priority one arrives, 8 for a normal one
            "admission": {"max_requests": 10, "low_priority_fill": 0.5},
            "routing": {"policy": "least_outstanding_tokens"},
            "resilience": quiet,  # no health check finds the stopped replicas out
            "drift_probe": {"enabled": False},
        },
        "autoscale": {"min_replicas": 1, "max_replicas": 1, "max_unresponsive_s": 600},
    }


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    workdir = tmp_path_factory.mktemp("tiers")
    storage = Storage(workdir / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, tiny_llama_dir, "fp16"))
    publish_variant(storage, SLUG, tiny_llama_dir, "int4")  # the cheaper tier's variant
    with UpProcess(tiers_config(), storage.root, SLUG, workdir).running() as up:
        up.metrics_key = METRICS_KEY
        up.wait_for(lambda: len(up.replicas()) == 2 and economy_is_ready(up), 120,
                    "the economy tier's replica")  # fmt: skip
        yield up


def economy_is_ready(up: UpProcess) -> bool:
    return up.metric("modelship_gateway_replicas", track="economy", state="ready") == 1


def client(fleet: UpProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=key, max_retries=0, timeout=120)


def ask(fleet: UpProcess, key: str, max_tokens: int = 8, **headers: str):
    """The raw response (headers and parsed body) of a chat request."""
    return client(fleet, key).chat.completions.with_raw_response.create(
        model=SLUG,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=max_tokens,
        extra_headers=headers,
    )


class Held:
    """A request sent from a thread: it waits at a stopped replica until SIGCONT."""

    def __init__(self, fleet: UpProcess, key: str) -> None:
        self.response = None
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, args=(fleet, key), daemon=True)
        self._thread.start()

    def _run(self, fleet: UpProcess, key: str) -> None:
        try:
            self.response = ask(fleet, key)
        except Exception as exc:  # read by the test
            self.error = exc

    def result(self):
        self._thread.join(timeout=120)
        assert self.error is None, self.error
        return self.response


def decided(fleet: UpProcess, n: int) -> None:
    fleet.wait_for(lambda: fleet.metric(DECISIONS) >= n, 30, f"{n} tier decisions")


def test_overload_browns_out_to_the_cheaper_tier_before_any_refusal(fleet: UpProcess) -> None:
    replicas = fleet.replicas()
    assert len(replicas) == 2
    economy = [r for r in replicas if "int4" in " ".join(r.cmdline())]
    assert len(economy) == 1, [r.cmdline() for r in replicas]
    base = fleet.metric(DECISIONS)
    for replica in replicas:
        replica.send_signal(signal.SIGSTOP)
    held: list[tuple[str, Held]] = []
    try:
        # Two low-priority requests fill the primary (2 per replica)...
        for i in range(2):
            held.append(("primary", Held(fleet, BATCH_KEY)))
            decided(fleet, base + i + 1)
        # ... a tenant that opted out stays on it, however full ...
        held.append(("vip", Held(fleet, VIP_KEY)))
        decided(fleet, base + 3)
        assert fleet.metric(DECISIONS, tier="primary", reason="opted_out") == 1
        # ... the next low-priority ones go to the cheaper tier, not to a refusal ...
        for i in range(2):
            held.append(("economy", Held(fleet, BATCH_KEY)))
            decided(fleet, base + 4 + i)
        assert fleet.metric(DECISIONS, tier="economy", reason="brownout") == 2
        assert fleet.metric("modelship_gateway_rejections_total") == 0
        # ... and only with both tiers full is anything refused (admission: 5 held)
        with pytest.raises(openai.APIStatusError) as refused:
            ask(fleet, BATCH_KEY)
        assert refused.value.status_code == 503
    finally:
        for replica in replicas:
            with contextlib.suppress(psutil.NoSuchProcess):
                replica.send_signal(signal.SIGCONT)
    for where, request in held:
        response = request.result()
        assert response.parse().choices[0].message.content is not None
        variant = response.headers["x-modelship-variant"]
        tier = response.headers["x-modelship-tier"]
        if where == "economy":
            assert (variant, tier) == ("int4", "economy")
        else:  # the vip request included: never degraded
            assert (variant, tier) == ("fp16", "primary"), where
    served = fleet.metric("modelship_gateway_requests_total", status="200", variant="int4")
    assert served == 2


def test_tier_rules_and_a_named_tier(fleet: UpProcess) -> None:
    # A short low-priority request matches the `short` rule: the economy tier
    response = ask(fleet, BATCH_KEY, max_tokens=4)
    assert response.headers["x-modelship-variant"] == "int4"
    assert fleet.metric(DECISIONS, tier="economy", reason="short") >= 1
    # Naming the dearer primary does not escape the rule
    escape = ask(fleet, BATCH_KEY, max_tokens=4, **{"x-modelship-tier": "primary"})
    assert escape.headers["x-modelship-tier"] == "economy"
    assert fleet.metric(DECISIONS, tier="economy", reason="denied") == 1
    # A longer one does not: the primary
    assert ask(fleet, BATCH_KEY, max_tokens=8).headers["x-modelship-variant"] == "fp16"
    # The opted-out tenant matches no rule that would degrade it...
    assert ask(fleet, VIP_KEY, max_tokens=4).headers["x-modelship-variant"] == "fp16"
    # ... but a tier it names itself is its choice
    named = ask(fleet, VIP_KEY, **{"x-modelship-tier": "economy"})
    assert named.headers["x-modelship-tier"] == "economy"
    assert fleet.metric(DECISIONS, tier="economy", reason="requested") >= 1
    with pytest.raises(openai.BadRequestError) as unknown:
        ask(fleet, VIP_KEY, **{"x-modelship-tier": "gold"})
    error = unknown.value.body
    assert (error["code"], error["param"]) == ("unknown_tier", "x-modelship-tier")
    assert "primary, economy" in error["message"]


def test_a_tier_whose_variant_was_never_built_is_named(tiny_llama_dir: Path, tmp_path: Path):
    from modelship.config import ModelshipConfig
    from modelship.fleet.local import LocalFleet
    from modelship.pipeline.errors import PipelineError

    storage = Storage(tmp_path / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, tiny_llama_dir, "fp16"))
    config = ModelshipConfig.from_dict(tiers_config(), "pipeline.yaml")
    with pytest.raises(PipelineError) as info:
        LocalFleet(config, storage, SLUG)
    message = str(info.value)
    assert "tier 'economy' serves variant 'int4'" in message
    assert str(storage.variant_dir(SLUG, "int4")) in message


def test_a_tier_replica_is_probed_against_its_own_variants_golden_answers(
    tiny_llama_dir: Path, tmp_path: Path
):
    """The drift probe compares a replica with what select recorded for the variant it
    serves: a cheaper tier's gptq replica is not held to the fp16 release's answers."""
    import json

    from modelship.config import ModelshipConfig
    from modelship.fleet.local import LocalFleet
    from modelship.release import golden

    def answer(text: str) -> dict:
        return {"prompt": "2+2=", "text": text, "tokens": [text], "logprobs": [-0.1]}

    storage = Storage(tmp_path / "storage")
    release = publish_release(storage, SLUG, tiny_llama_dir, "fp16")
    storage.set_production(SLUG, release)
    publish_variant(storage, SLUG, tiny_llama_dir, "int4")
    folder = storage.release_dir(SLUG, release)
    golden.write_reference(folder / golden.GOLDEN_FILE, [golden.GoldenAnswer(**answer("4"))])
    evaluations = {"int4": {"serving": {"golden": [answer("four")]}}, "awq": {"serving": {}}}
    (folder / "production_metrics.json").write_text(json.dumps({"evaluations": evaluations}))
    fleet = LocalFleet(ModelshipConfig.from_dict(tiers_config()), storage, SLUG)

    assert [a.text for a in fleet._golden_reference(str(release), "fp16")] == ["4"]
    assert [a.text for a in fleet._golden_reference(str(release), "int4")] == ["four"]
    assert fleet._golden_reference(str(release), "awq") is None  # not recorded: not probed
