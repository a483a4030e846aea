"""The cross-checks find what schemas cannot: each broken object is reported, by path."""

from __future__ import annotations

import copy
from decimal import Decimal

import pytest
from k8s_tools import config_for, one

from modelship.deploy.checks import check_objects
from modelship.deploy.quantity import QuantityError, parse_quantity
from modelship.deploy.render import render

NAME = "smollm2-135m-instruct"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", Decimal("0.5")),
        ("2", Decimal(2)),
        ("8Gi", Decimal(8 * 2**30)),
        ("1.5G", Decimal("1.5e9")),
        ("1e3", Decimal(1000)),
        ("1E-2", Decimal("0.01")),
        ("2E", Decimal("2e18")),
        (".5", Decimal("0.5")),
        (3, Decimal(3)),
    ],
)
def test_parse_quantity(text: str | int, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "8GB", "1.2.3", "Gi", "two", "5 Mi", "1e", "0x10"])
def test_parse_quantity_rejects(text: str) -> None:
    with pytest.raises(QuantityError, match="not a Kubernetes quantity"):
        parse_quantity(text)


@pytest.fixture
def objects() -> list[dict]:
    return copy.deepcopy(render(config_for("deployment", canary=True)).objects)


def engine(objects: list[dict]) -> dict:
    return one(objects, "Deployment", f"{NAME}-engine")


def container(objects: list[dict]) -> dict:
    return engine(objects)["spec"]["template"]["spec"]["containers"][0]


def test_rendered_objects_pass(objects: list[dict]) -> None:
    assert check_objects(objects) == []


def test_selector_must_match_template_labels(objects: list[dict]) -> None:
    engine(objects)["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "x"
    [error] = check_objects(objects)
    assert error.object == f"Deployment/{NAME}-engine"
    assert error.path == "spec.selector.matchLabels" and "does not match" in error.message


def test_service_and_pdb_must_select_pods(objects: list[dict]) -> None:
    one(objects, "Service", f"{NAME}-engine")["spec"]["selector"]["app.kubernetes.io/instance"] = (
        "y"
    )
    pdb = one(objects, "PodDisruptionBudget", f"{NAME}-gateway")
    pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "z"
    errors = check_objects(objects)
    assert {error.object for error in errors} == {
        f"Service/{NAME}-engine",
        f"PodDisruptionBudget/{NAME}-gateway",
    }
    assert all("selects no pod" in error.message for error in errors)


def test_quantities_must_parse(objects: list[dict]) -> None:
    container(objects)["resources"]["requests"]["memory"] = "4GB"
    one(objects, "PersistentVolumeClaim")["spec"]["resources"]["requests"]["storage"] = "lots"
    errors = check_objects(objects)
    paths = sorted(error.path for error in errors)
    assert paths == [
        "spec.resources.requests.storage",
        "spec.template.spec.containers[0].resources.requests.memory",
    ]


def test_limits_must_cover_requests(objects: list[dict]) -> None:
    container(objects)["resources"] = {"requests": {"memory": "4Gi"}, "limits": {"memory": "4G"}}
    [error] = check_objects(objects)
    assert "memory limit 4G < request 4Gi" in error.message


def test_gpus_cannot_be_overcommitted_or_fractional(objects: list[dict]) -> None:
    container(objects)["resources"] = {
        "requests": {"nvidia.com/gpu": "1"},
        "limits": {"nvidia.com/gpu": "2"},
    }
    canary = one(objects, "Deployment", f"{NAME}-engine-canary")
    canary["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "limits": {"nvidia.com/gpu": "500m"}
    }
    messages = [error.message for error in check_objects(objects)]
    assert any("request 1 != limit 2" in m for m in messages)
    assert any("whole number" in m for m in messages)


def test_every_claim_and_config_map_must_be_in_the_render(objects: list[dict]) -> None:
    volumes = engine(objects)["spec"]["template"]["spec"]["volumes"]
    volumes[0]["persistentVolumeClaim"]["claimName"] = "elsewhere"
    workflow = one(objects, "Workflow")
    workflow["spec"]["volumes"][1]["configMap"]["name"] = "missing"
    messages = [str(error) for error in check_objects(objects)]
    assert any("'elsewhere' is not in the render" in m for m in messages)
    assert any("ConfigMap 'missing' is not in the render" in m for m in messages)


def test_config_and_serve_device_must_be_what_the_engine_takes(objects: list[dict]) -> None:
    args = container(objects)["args"]
    args[args.index("--device") + 1] = "gpu"
    config_map = one(objects, "ConfigMap", f"{NAME}-config")
    config_map["data"]["pipeline.yaml"] += "serve:\n  engine:\n    device: gpu\n"
    errors = {error.object: error for error in check_objects(objects)}
    assert errors[f"Deployment/{NAME}-engine"].path.endswith("containers[0].args")
    assert "got 'gpu'" in errors[f"Deployment/{NAME}-engine"].message
    assert "serve.engine.device" in errors[f"ConfigMap/{NAME}-config"].message


def test_mounts_need_a_volume(objects: list[dict]) -> None:
    container(objects)["volumeMounts"].append({"name": "scratch", "mountPath": "/scratch"})
    [error] = check_objects(objects)
    assert "'scratch'" in error.message


def test_probe_ports_must_exist(objects: list[dict]) -> None:
    container(objects)["readinessProbe"]["httpGet"]["port"] = "metrics"
    container(objects)["livenessProbe"]["httpGet"]["port"] = 9999
    errors = check_objects(objects)
    assert sorted(error.path.rsplit(".", 1)[1] for error in errors) == [
        "livenessProbe",
        "readinessProbe",
    ]


def test_autoscaler_must_target_a_rendered_deployment(objects: list[dict]) -> None:
    one(objects, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] = "nope"
    [error] = check_objects(objects)
    assert error.path == "spec.scaleTargetRef"


def test_service_ports_must_not_repeat(objects: list[dict]) -> None:
    ports = one(objects, "Service", f"{NAME}-gateway")["spec"]["ports"]
    ports[1]["port"] = ports[0]["port"]
    [error] = check_objects(objects)
    assert "repeated port port" in error.message


def test_workflow_and_inference_service_pods_are_checked() -> None:
    objects = copy.deepcopy(render(config_for("kserve")).objects)
    predictor = one(objects, "InferenceService")["spec"]["predictor"]
    predictor["containers"][0]["readinessProbe"]["httpGet"]["port"] = 1234
    workflow = one(objects, "Workflow")
    optimize = next(t for t in workflow["spec"]["templates"] if t["name"] == "optimize")
    optimize["container"]["resources"]["limits"]["memory"] = "1Mi"
    objects_with_errors = {error.object for error in check_objects(objects)}
    assert objects_with_errors == {
        f"InferenceService/{NAME}",
        f"Workflow/{NAME}-pipeline-",
    }
