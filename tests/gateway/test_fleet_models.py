"""Two models behind one `modelship up` (`models:` in pipeline.yaml): the tiny Llama as the
config's own model and a second random tiny Llama (same tokenizer, another seed) made here,
each a production release on one storage and each run by replicas of its own. Requests are
routed by model name through the openai SDK; /v1/models lists both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from modelship.storage import Storage

from fleet_process import UpProcess
from fleet_storage import publish_release
from tiny_models import make_tiny_llama

SLUG, OTHER = "tiny", "tiny-b"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    workdir = tmp_path_factory.mktemp("models")
    other_dir = make_tiny_llama(workdir / "other-model", seed=1)
    storage = Storage(workdir / "storage")
    storage.set_production(SLUG, publish_release(storage, SLUG, tiny_llama_dir, "fp16"))
    storage.set_production(OTHER, publish_release(storage, OTHER, other_dir, "fp16"))
    config = {
        "serve": {"engine": {"max_model_len": 128, "kv_cache_memory_mb": 8}},
        "gateway": {"drift_probe": {"enabled": False}},
        "autoscale": {"min_replicas": 1, "max_replicas": 1},
        # Its own autoscaling: the second model's bounds are not the first's.
        "models": [{"name": OTHER, "autoscale": {"min_replicas": 1, "max_replicas": 2}}],
    }
    with UpProcess(config, storage.root, SLUG, workdir).running() as up:
        up.wait_for(lambda: len(up.replicas()) == 2, 300, "a replica of each model")
        up.wait_for(lambda: both_answer(up), 300, "both models answering")
        yield up


def client(fleet: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0, timeout=60)


def both_answer(fleet: UpProcess) -> bool:
    try:
        return len(client(fleet).models.list().data) == 2
    except openai.APIError:
        return False


def test_up_serves_two_models_each_on_its_own_replicas(fleet: UpProcess):
    sdk = client(fleet)
    assert sorted(card.id for card in sdk.models.list()) == [SLUG, OTHER]
    for name in (SLUG, OTHER, OTHER, SLUG):
        raw = sdk.completions.with_raw_response.create(model=name, prompt="hello", max_tokens=3)
        assert raw.headers["x-modelship-model"] == name
        assert raw.parse().model == name
    with pytest.raises(openai.NotFoundError) as error:
        sdk.completions.create(model="gpt-9", prompt="hello", max_tokens=3)
    assert error.value.body["code"] == "model_not_found"
    # Each model's replicas are a group of their own on the gauges.
    assert fleet.metric("modelship_gateway_replicas", track=f"{OTHER}/stable", state="ready") == 1
    assert fleet.metric("modelship_gateway_replicas", track="stable", state="ready") == 1
