"""Prefix-cache isolation between tenants, end to end: `modelship up` with tenants, the
replica's own prefix-cache counters read from its /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelship.gateway import hash_api_key
from modelship.gateway.tenants import Tenant, TenantConfig
from modelship.storage import Storage

from fleet_process import UpProcess
from fleet_storage import publish_release

SLUG = "tiny"
KEYS = {"alpha": "sk-alpha-c", "beta": "sk-beta-c", "carol": "sk-carol-c", "dave": "sk-dave-c"}
# About 170 tokens (the tiny tokenizer is nearly one per character): 10 blocks of 16.
PROMPT = "Prefix caching reuses the key and value blocks of a prompt seen before. " * 3

pytestmark = pytest.mark.timeout(300)


def tenant(name: str, namespace: str | None = None) -> Tenant:
    config = TenantConfig(name=name, api_key_sha256=hash_api_key(name), cache_namespace=namespace)
    return Tenant(name, config)


def test_cache_salts_are_per_tenant_unless_a_namespace_is_shared() -> None:
    alpha, beta = tenant("alpha"), tenant("beta")
    assert alpha.cache_salt != beta.cache_salt
    assert tenant("carol", "team").cache_salt == tenant("dave", "team").cache_salt
    # A shared namespace never lands in a tenant's own, whatever the names.
    assert tenant("x", "alpha").cache_salt != alpha.cache_salt
    assert alpha.cache_salt.isascii() and "alpha" not in alpha.cache_salt
    assert tenant("é ü").cache_salt.isascii()  # any name makes a valid header value


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    workdir = tmp_path_factory.mktemp("cache-fleet")
    storage = Storage(workdir / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, tiny_llama_dir, "fp16"))
    tenants = [
        {"name": name, "api_key_sha256": hash_api_key(key)}
        for name, key in KEYS.items()
        if name in ("alpha", "beta")
    ] + [
        {"name": name, "api_key_sha256": hash_api_key(KEYS[name]), "cache_namespace": "team"}
        for name in ("carol", "dave")
    ]
    config = {
        # No serve.api_key: the fleet makes up the key its replicas trust the namespace from.
        "serve": {"engine": {"max_model_len": 256, "kv_cache_memory_mb": 16}},
        "gateway": {"tenants": tenants},
        "autoscale": {"min_replicas": 1, "max_replicas": 1},
    }
    with UpProcess(config, storage.root, SLUG, workdir).running() as up:
        yield up


def replica_url(fleet: UpProcess) -> str:
    (replica,) = fleet.replicas()
    return fleet.replica_url(replica)


def prefix_hits(fleet: UpProcess) -> float:
    text = httpx.get(f"{replica_url(fleet)}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "modelship:prefix_cache_hits_total"
    )


def hits_of(fleet: UpProcess, tenant: str, prompt: str) -> float:
    """Send `prompt` as `tenant`; the prompt tokens the replica's prefix cache served."""
    before = prefix_hits(fleet)
    response = httpx.post(
        f"{fleet.url}/v1/completions",
        json={"model": SLUG, "prompt": prompt, "max_tokens": 2, "temperature": 0},
        headers={"authorization": f"Bearer {KEYS[tenant]}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return prefix_hits(fleet) - before


def test_a_tenant_hits_its_own_prefix_and_never_another_tenants(fleet: UpProcess) -> None:
    assert hits_of(fleet, "alpha", PROMPT) == 0
    assert hits_of(fleet, "beta", PROMPT) == 0  # alpha's blocks are cached, but not beta's
    assert hits_of(fleet, "alpha", PROMPT) >= 6 * 16
    assert hits_of(fleet, "beta", PROMPT) >= 6 * 16


def test_tenants_that_opt_into_a_namespace_share_it(fleet: UpProcess) -> None:
    prompt = "A shared namespace is a choice both tenants make in the gateway config. " * 3
    assert hits_of(fleet, "carol", prompt) == 0
    assert hits_of(fleet, "dave", prompt) >= 6 * 16
    assert hits_of(fleet, "alpha", prompt) == 0


def test_the_replica_refuses_a_namespace_from_a_client_without_its_key(fleet: UpProcess) -> None:
    body = {"model": SLUG, "prompt": PROMPT, "max_tokens": 2}
    headers = {"x-modelship-cache-salt": "anything", "authorization": f"Bearer {KEYS['alpha']}"}
    response = httpx.post(f"{replica_url(fleet)}/v1/completions", json=body, headers=headers)
    assert response.status_code == 401  # a tenant's key is not the replica's
