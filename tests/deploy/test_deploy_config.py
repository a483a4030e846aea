"""The deploy section: defaults render, every error names its field; names and slugs."""

from __future__ import annotations

import pytest

from modelship.config import ConfigError, ModelshipConfig
from modelship.deploy.names import dns_name, model_slug
from modelship.deploy.render import RenderError, render


def load_error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        ModelshipConfig.from_dict(data, "pipeline.yaml")
    return str(info.value)


def test_defaults() -> None:
    deploy = ModelshipConfig.from_dict({}).deploy
    assert deploy.serving.kind == "deployment" and deploy.serving.autoscaler == "hpa"
    assert deploy.serving.engine == "ours" and deploy.serving.gpu is None
    assert deploy.serving.min_replicas >= 1
    assert deploy.storage.access_mode == "ReadWriteMany"


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        (
            {"serving": {"min_replicas": 3, "max_replicas": 2}},
            "deploy.serving.max_replicas",
            "below min_replicas 3",
        ),
        (
            {"serving": {"min_replicas": 0}},
            "deploy.serving.min_replicas",
            "greater than or equal to 1",
        ),
        ({"serving": {"engine": "vllm"}}, "deploy.serving.gpu", "engine vllm needs a gpu"),
        ({"serving": {"kind": "knative"}}, "deploy.serving.kind", "'kserve' or 'deployment'"),
        (
            {"serving": {"canary": {"release": 2, "weight": 100}}},
            "deploy.serving.canary.weight",
            "less than or equal to 99",
        ),
        (
            {"serving": {"release": 2, "canary": {"release": 2, "weight": 5}}},
            "deploy.serving.canary",
            "already the stable release",
        ),
        (
            {"serving": {"resources": {"requests": {"memory": "8GB"}}}},
            "deploy.serving.resources.requests.memory",
            "not a Kubernetes quantity",
        ),
        (
            {"serving": {"resources": {"requests": {"cpu": 4}, "limits": {"cpu": "3"}}}},
            "deploy.serving.resources.limits",
            "cpu limit 3 is below its request 4",
        ),
        (
            {"serving": {"gpu": {"tolerations": [{"key": "k", "value": "v"}]}}},
            "deploy.serving.gpu.tolerations.0.value",
            "operator Exists must not have a value",
        ),
        (
            {"serving": {"gpu": {"node_labels": {"bad key!": "x"}}}},
            "deploy.serving.gpu.node_labels",
            "not a valid label key",
        ),
        ({"namespace": "Prod"}, "deploy.namespace", "must be a DNS label"),
        ({"name": "9lives"}, "deploy.name", "starting with a letter"),
        ({"storage": {"size": "-5Gi"}}, "deploy.storage.size", "negative"),
        ({"workflow": {"memoize_max_age": "1 day"}}, "deploy.workflow.memoize_max_age", "24h"),
        (
            {"workflow": {"transient_exit_codes": [0]}},
            "deploy.workflow.transient_exit_codes",
            "1..255",
        ),
        ({"serving": {"replicas": 3}}, "deploy.serving.replicas", "Extra inputs"),
    ],
)
def test_errors_name_the_field(data: dict, field: str, message: str) -> None:
    error = load_error({"deploy": data})
    assert f"pipeline.yaml: {field}: " in error
    assert message in error


def test_cpu_engine_on_gpus_is_refused_naming_the_field() -> None:
    config = ModelshipConfig.from_dict({"deploy": {"serving": {"gpu": {"count": 1}}}})
    with pytest.raises(RenderError, match=r"^serve\.engine\.device: is 'cpu'"):
        render(config)


def test_metrics_port_collision_is_refused() -> None:
    config = ModelshipConfig.from_dict({"serve": {"port": 9090}})
    with pytest.raises(RenderError, match=r"serve\.port: 9090 is the Services' metrics port"):
        render(config)


def test_knative_reserved_port_is_refused_for_kserve() -> None:
    config = ModelshipConfig.from_dict({"serve": {"port": 8012}})
    render(config)  # fine for Deployments
    kserve = ModelshipConfig.from_dict(
        {"serve": {"port": 8012}, "deploy": {"serving": {"kind": "kserve"}}}
    )
    with pytest.raises(RenderError, match=r"serve\.port: 8012 is reserved by Knative"):
        render(kserve)


def test_model_slug_matches_acquire_without_touching_disk() -> None:
    from modelship.pipeline.acquire import DEMO_SLUG, resolve_source

    assert model_slug("demo") == DEMO_SLUG
    for repo in ("HuggingFaceTB/SmolLM2-135M", "Qwen/Qwen2.5-0.5B-Instruct"):
        assert model_slug(repo) == resolve_source(repo).slug
    assert model_slug("/data/incoming/TinyLlama.Q4_0.gguf") == "tinyllama.q4_0"
    assert model_slug("/data/incoming/my-model") == "my-model"
    assert model_slug("anything", name="Custom Name") == "custom-name"


@pytest.mark.parametrize(
    ("slug", "name"),
    [
        ("smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("qwen--qwen2.5-0.5b-instruct", "qwen-qwen2-5-0-5b-instruct"),
        ("7b-model", "m-7b-model"),
        ("a" * 80, "a" * 40),
    ],
)
def test_dns_name(slug: str, name: str) -> None:
    assert dns_name(slug) == name


def test_explicit_name_prefixes_every_object() -> None:
    rendered = render(ModelshipConfig.from_dict({"deploy": {"name": "chat"}}))
    names = [  # the Namespace is named by deploy.namespace, not the prefix
        obj["metadata"].get("name") or obj["metadata"]["generateName"]
        for obj in rendered.objects
        if obj["kind"] != "Namespace"
    ]
    assert all(name.startswith("chat-") or name == "modelship-data" for name in names)
