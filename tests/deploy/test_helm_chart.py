"""The Helm chart renders the same serving objects as `deploy render --serving deployment`."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_tools import CHART_DIR, config_for, one

from modelship.config import ModelshipConfig
from modelship.deploy.checks import check_objects
from modelship.deploy.context import RenderContext
from modelship.deploy.dashboard import dashboard_json
from modelship.deploy.helm_values import helm_values
from modelship.deploy.render import render
from modelship.deploy.validate import validate_objects

Json = dict[str, Any]
NAME = "smollm2-135m-instruct"  # the default config's
TIERS = {
    "tiers": [
        {"name": "economy", "variant": "gptq", "min_replicas": 1, "max_replicas": 3},
        {"name": "bulk", "variant": "int4", "min_replicas": 2, "max_replicas": 5},
    ]
}
# A second model behind the gateway, scaled on its own (`models:`).
MODELS = [{"name": "tiny-llama", "served_model_name": "tiny",
           "autoscale": {"min_replicas": 2, "max_replicas": 5}}]  # fmt: skip
CASES = {
    "cpu-hpa": lambda: config_for("deployment", "hpa"),
    "gpu-keda-canary": lambda: config_for("deployment", "keda", "gpu", canary=True),
    "vllm-hpa-api-key": lambda: config_for("deployment", "hpa", "vllm", serve={"api_key": "k"}),
    "pinned-release-named": lambda: config_for(
        deploy={"name": "chat", "namespace": "llm", "serving": {"release": 3}},
        serve={"grace_period_s": 2.5, "served_model_name": "chat-model"},
    ),
    "cpu-hpa-tiers": lambda: config_for("deployment", "hpa", gateway=TIERS),
    "gpu-keda-canary-tiers": lambda: config_for("deployment", "keda", "gpu", True, gateway=TIERS),
    "vllm-hpa-tiers": lambda: config_for("deployment", "hpa", "vllm", gateway=TIERS),
    "cpu-hpa-models": lambda: config_for("deployment", "hpa", models=MODELS),
    "gpu-keda-canary-tiers-models": lambda: config_for(
        "deployment", "keda", "gpu", True, gateway=TIERS, models=MODELS
    ),
}


def run_helm(helm: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )


def helm_template(helm: Path, values: Json, tmp_path: Path) -> list[Json]:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    result = run_helm(helm, "template", "release", CHART_DIR, "-f", values_file)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def keyed(objects: list[Json]) -> dict[tuple[str, str], Json]:
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}


def test_chart_lints(helm: Path) -> None:
    result = run_helm(helm, "lint", "--strict", CHART_DIR)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_ships_the_dashboard_deploy_render_writes() -> None:
    shipped = (CHART_DIR / "files" / "grafana-dashboard.json").read_text()
    assert shipped == dashboard_json()  # regenerate: python -m modelship.deploy.dashboard


def test_chart_defaults_are_the_default_config() -> None:
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    expected = helm_values(RenderContext.from_config(ModelshipConfig.from_dict({})))
    assert defaults == expected


@pytest.mark.parametrize("case", CASES)
def test_chart_renders_what_deploy_render_does(
    case: str, helm: Path, tmp_path: Path, schema_dir: Path
) -> None:
    rendered = render(CASES[case]())
    assert rendered.helm_values is not None
    charted = keyed(helm_template(helm, rendered.helm_values, tmp_path))
    expected = keyed(rendered.files["serving.yaml"] + rendered.files["monitoring.yaml"])

    assert sorted(charted) == sorted(expected)
    for key, ours in expected.items():
        theirs = charted[key]
        assert theirs["apiVersion"] == ours["apiVersion"], key
        assert theirs["metadata"]["namespace"] == ours["metadata"]["namespace"], key
        # Labels: the chart adds Helm's own; the identifying ones must agree.
        for label in ("app.kubernetes.io/instance", "app.kubernetes.io/component"):
            assert theirs["metadata"]["labels"][label] == ours["metadata"]["labels"][label]
        assert theirs.get("spec") == ours.get("spec"), key
        assert theirs.get("data") == ours.get("data"), key  # the dashboard's ConfigMap

    # The chart's objects are valid on their own terms, with the render's cluster objects.
    objects = list(charted.values()) + rendered.files["cluster.yaml"]
    assert validate_objects(objects, schema_dir) == []
    assert check_objects(objects) == []


@pytest.mark.parametrize("autoscaler", ["hpa", "keda"])
def test_chart_renders_a_tier_as_deploy_render_does(
    autoscaler: str, helm: Path, tmp_path: Path
) -> None:
    rendered = render(config_for("deployment", autoscaler, gateway=TIERS))
    assert rendered.helm_values is not None
    assert rendered.helm_values["tiers"][0] == {
        "name": "economy", "variant": "gptq", "minReplicas": 1, "maxReplicas": 3,
    }  # fmt: skip
    charted = helm_template(helm, rendered.helm_values, tmp_path)
    expected = rendered.files["serving.yaml"]
    name = f"{NAME}-engine-tier-economy"

    def engine(objects: list[Json]) -> Json:
        spec = one(objects, "Deployment", name)["spec"]
        return {
            "serves": spec["template"]["metadata"]["annotations"]["modelship.io/serves"],
            "args": spec["template"]["spec"]["containers"][0]["args"],
            "selector": spec["selector"],
        }

    def scaling(objects: list[Json]) -> tuple[int, int, str]:
        if autoscaler == "keda":
            spec = one(objects, "ScaledObject", name)["spec"]
            bounds = (spec["minReplicaCount"], spec["maxReplicaCount"])
        else:
            spec = one(objects, "HorizontalPodAutoscaler", name)["spec"]
            bounds = (spec["minReplicas"], spec["maxReplicas"])
        return (*bounds, spec["scaleTargetRef"]["name"])

    def discovered(objects: list[Json]) -> tuple[str, dict[str, str]]:
        """The Services the gateway discovers pods of, and the tier Service's labels the
        gateway reads from its EndpointSlices."""
        gateway = one(objects, "Deployment", f"{NAME}-gateway")
        env = gateway["spec"]["template"]["spec"]["containers"][0]["env"]
        labels = one(objects, "Service", name)["metadata"]["labels"]
        ours = {key: value for key, value in labels.items() if key.startswith("modelship.io/")}
        return {e["name"]: e.get("value") for e in env}["MODELSHIP_GATEWAY_DISCOVER_SERVICES"], ours

    ours = engine(charted)
    assert ours["serves"] == "optimized/gptq"
    assert ours["args"][1] == f"/data/models/{NAME}/optimized/gptq"
    assert ours["args"][-2:] == ["--variant", "gptq"]
    assert "replicas" not in one(charted, "Deployment", name)["spec"]  # its autoscaler's
    assert ours == engine(expected)
    assert one(charted, "Service", name)["spec"] == one(expected, "Service", name)["spec"]
    assert scaling(charted) == scaling(expected) == (1, 3, name)
    services = f"{NAME}-engine,{name},{NAME}-engine-tier-bulk"
    labels = {"modelship.io/model": NAME, "modelship.io/track": "stable",
              "modelship.io/tier": "economy", "modelship.io/variant": "gptq"}  # fmt: skip
    assert discovered(charted) == discovered(expected) == (services, labels)


def test_chart_renders_another_model_as_deploy_render_does(helm: Path, tmp_path: Path) -> None:
    rendered = render(config_for("deployment", "hpa", models=MODELS))
    assert rendered.helm_values is not None
    assert rendered.helm_values["models"] == [{
        "slug": "tiny-llama", "servedModelName": "tiny", "label": "tiny-llama",
        "minReplicas": 2, "maxReplicas": 5,
    }]  # fmt: skip
    charted = helm_template(helm, rendered.helm_values, tmp_path)
    name = f"{NAME}-tiny-llama-engine"
    container = one(charted, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["serve", "/data/models/tiny-llama/production"]
    assert container["args"][container["args"].index("--served-model-name") + 1] == "tiny"
    labels = one(charted, "Service", name)["metadata"]["labels"]
    assert labels["modelship.io/model"] == "tiny-llama"  # the gateway routes "tiny" there
    scaling = one(charted, "HorizontalPodAutoscaler", name)["spec"]
    assert (scaling["minReplicas"], scaling["maxReplicas"]) == (2, 5)
    assert one(charted, "PodDisruptionBudget", name)
    gateway = one(charted, "Deployment", f"{NAME}-gateway")
    env = {
        e["name"]: e.get("value")
        for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["MODELSHIP_GATEWAY_DISCOVER_SERVICES"] == f"{NAME}-engine,{name}"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("autoscaling.autoscaler=prometheus", "autoscaler"),
        ("canary.weight=100", "weight"),
        ("engine.port=9090", "port"),
        ("replicas=3", "replicas"),
        (
            "tiers[0].name=canary,tiers[0].variant=gptq,tiers[0].minReplicas=1,"
            "tiers[0].maxReplicas=1",
            "/tiers/0/name",
        ),
        ("tiers[0].name=economy,tiers[0].variant=gptq", "maxReplicas"),
        (
            "models[0].slug=tiny,models[0].servedModelName=tiny,models[0].label=Tiny_Llama,"
            "models[0].minReplicas=1,models[0].maxReplicas=1",
            "/models/0/label",
        ),
    ],
)
def test_values_schema_rejects_bad_values(helm: Path, override: str, message: str) -> None:
    result = run_helm(helm, "template", "release", CHART_DIR, "--set", override)
    assert result.returncode != 0
    assert message in result.stderr


def test_kserve_render_writes_no_helm_values() -> None:
    assert render(config_for("kserve")).helm_values is None
