"""Several models behind one gateway (`gateway/models.py`): a standalone gateway finds the
pods of two models in a stand-in Kubernetes API (`modelship.io/model` labels on their
EndpointSlices), routes each request by its `model` field, lists both in /v1/models, and
applies a tenant's `allowed_models`; a model tier sends a request to the other model. The
replicas are real `modelship serve` processes of one tiny random Llama under two names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway_process import GatewayProcess
from kube_stand_in import KubeStandIn
from modelship.gateway import hash_api_key
from modelship.gateway.discovery import MODEL_LABEL

from server_process import ServerProcess

SERVICE = "tiny-engine"
KEY = "sk-replica-test"  # the replicas' key, which the gateway holds
ALL, ONLY_B = "sk-tenant-all", "sk-tenant-only-b"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path) -> Iterator[dict[str, ServerProcess]]:
    """One replica of each model: `tiny` (the config's own) and `tiny-b` (from `models:`)."""
    args = ["--max-model-len", "128", "--kv-cache-memory-mb", "8"]
    started = {
        name: ServerProcess(
            tiny_llama_dir, "--served-model-name", name, *args, api_key=KEY, timeout_s=300
        )
        for name in ("tiny", "tiny-b")
    }
    yield started
    for process in started.values():
        process.stop()


@pytest.fixture
def gateway(tmp_path: Path, replicas: dict[str, ServerProcess]) -> Iterator[GatewayProcess]:
    kube = KubeStandIn().start()
    for name, replica in replicas.items():  # the render labels each model's pods so
        kube.put_pod(SERVICE, name, replica.port, labels={MODEL_LABEL: name})
    tenants = [
        {"name": "all", "api_key_sha256": hash_api_key(ALL)},
        {"name": "only-b", "api_key_sha256": hash_api_key(ONLY_B), "allowed_models": ["tiny-b"]},
    ]
    config = {
        "routing": {"policy": "round_robin"},
        "discovery": {"services": [SERVICE], "namespace": kube.namespace},
        "tenants": tenants,
        # A model tier: short answers go to the other model.
        "tiers": [{"name": "small", "model": "tiny-b"}],
        "tier_rules": [{"name": "short", "tier": "small", "max_output_tokens": 1}],
    }
    sections = {"name": "tiny", "models": [{"name": "tiny-b"}]}
    process = GatewayProcess(tmp_path, config, "--kube-api", kube.url, api_key=KEY,
                             sections=sections)  # fmt: skip
    process.wait_ready(60)
    yield process
    assert process.stop() == 0, process.log_tail()
    kube.stop()


def client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


def test_requests_are_routed_by_model_name_and_the_listing_names_both(gateway: GatewayProcess):
    sdk = client(gateway, ALL)
    assert sorted(card.id for card in sdk.models.list()) == ["tiny", "tiny-b"]
    for name in ("tiny", "tiny-b", "tiny", "tiny-b"):
        raw = sdk.completions.with_raw_response.create(model=name, prompt="hello", max_tokens=3)
        assert raw.headers["x-modelship-model"] == name
        assert raw.parse().model == name  # the replica serving that name answered


def test_an_unknown_model_is_a_404_naming_it(gateway: GatewayProcess):
    with pytest.raises(openai.NotFoundError) as error:
        client(gateway, ALL).completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    body = error.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "`gpt-9`" in body["message"]


def test_a_tenant_sees_and_uses_only_its_allowed_models(gateway: GatewayProcess):
    sdk = client(gateway, ONLY_B)
    assert [card.id for card in sdk.models.list()] == ["tiny-b"]
    assert sdk.completions.create(model="tiny-b", prompt="hi", max_tokens=2).model == "tiny-b"
    with pytest.raises(openai.PermissionDeniedError) as error:
        sdk.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert error.value.body["code"] == "model_not_allowed"
    # A name no model serves is refused as not allowed too: no tenant learns which exist.
    with pytest.raises(openai.PermissionDeniedError):
        sdk.completions.create(model="gpt-9", prompt="hi", max_tokens=2)


def test_a_model_tier_sends_a_request_to_the_other_model(gateway: GatewayProcess):
    """`tier_rules` send one-token answers of `tiny` to the tier served by `tiny-b`; the
    headers say which model and tier answered, and so does the body's `model`."""
    sdk = client(gateway, ALL)
    raw = sdk.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert raw.headers["x-modelship-model"] == "tiny-b"
    assert raw.headers["x-modelship-tier"] == "small"
    assert raw.parse().model == "tiny-b"
    longer = sdk.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=3)
    assert longer.headers["x-modelship-model"] == "tiny"
    assert longer.headers["x-modelship-tier"] == "primary"
    stream = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 1, "stream": True},
        headers={"authorization": f"Bearer {ALL}"},
        timeout=30,
    )
    assert stream.status_code == 200 and stream.headers["x-modelship-model"] == "tiny-b"
