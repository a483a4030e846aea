"""`deploy render` with two models behind one gateway (`models:` in pipeline.yaml): one
engine Deployment, headless Service and autoscaler per model, labelled for the gateway's
discovery, and the gateway configured to discover both."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from k8s_tools import config_for, one

from modelship.config import ModelshipConfig
from modelship.deploy.checks import check_objects
from modelship.deploy.render import render
from modelship.deploy.validate import validate_objects

NAME = "smollm2-135m-instruct"
MODELS = [{"name": "tiny-b", "served_model_name": "tiny/b",
           "autoscale": {"min_replicas": 2, "max_replicas": 5}}]  # fmt: skip


@pytest.mark.parametrize("autoscaler", ["hpa", "keda"])
def test_two_models_render_valid_objects(autoscaler: str, schema_dir: Path) -> None:
    objects = render(config_for("deployment", autoscaler, models=MODELS)).objects
    assert validate_objects(objects, schema_dir) == []


@pytest.mark.parametrize("autoscaler", ["hpa", "keda"])
def test_each_model_has_its_engines_and_the_gateway_discovers_both(autoscaler: str) -> None:
    objects = render(config_for("deployment", autoscaler, models=MODELS)).objects
    assert check_objects(objects) == []
    primary, other = f"{NAME}-engine", f"{NAME}-tiny-b-engine"
    first, second = one(objects, "Deployment", primary), one(objects, "Deployment", other)
    container = second["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][1] == "/data/models/tiny-b/production"
    assert container["args"][container["args"].index("--served-model-name") + 1] == "tiny/b"
    # Each Deployment selects its own pods only.
    first_pods = first["spec"]["selector"]["matchLabels"]
    second_pods = second["spec"]["template"]["metadata"]["labels"]
    assert not first_pods.items() <= second_pods.items()
    assert one(objects, "PodDisruptionBudget", other)
    labels = one(objects, "Service", other)["metadata"]["labels"]
    assert labels["modelship.io/model"] == "tiny-b"
    assert one(objects, "Service", primary)["metadata"]["labels"]["modelship.io/model"] == NAME
    if autoscaler == "keda":
        scaled = one(objects, "ScaledObject", other)["spec"]
        assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (2, 5)
    else:
        hpa = one(objects, "HorizontalPodAutoscaler", other)["spec"]
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 5)
    gateway = one(objects, "Deployment", f"{NAME}-gateway")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in gateway["containers"][0]["env"]}
    assert env["MODELSHIP_GATEWAY_DISCOVER_SERVICES"] == f"{primary},{other}"
    # The gateway reads `models:` from the rendered pipeline.yaml: the labels it expects
    # are the ones rendered.
    config_map = next(o for o in objects if o["kind"] == "ConfigMap" and
                      "pipeline.yaml" in o.get("data", {}))  # fmt: skip
    rendered = ModelshipConfig.from_dict(yaml.safe_load(config_map["data"]["pipeline.yaml"]))
    catalog = rendered.model_catalog()
    assert catalog.model_of_label("tiny-b") == "tiny/b"
    assert catalog.model_of_label(NAME) is None  # the primary


def test_models_are_not_rendered_for_kserve() -> None:
    from modelship.deploy.render import RenderError

    with pytest.raises(RenderError, match=r"models: rendered for deploy\.serving\.kind"):
        render(config_for("kserve", models=MODELS))
