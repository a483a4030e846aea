"""`modelship deploy render/validate` through Typer's runner: files, errors, atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from modelship.cli.deploy import deploy_app

runner = CliRunner()


def invoke(*args: str | Path):
    return runner.invoke(deploy_app, [str(arg) for arg in args])


def kinds(path: Path) -> list[str]:
    return [doc["kind"] for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_render_writes_the_files(tmp_path: Path) -> None:
    out = tmp_path / "k8s"
    result = invoke("render", "--out", out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        ".modelship-render",
        "cluster.yaml",
        "grafana-dashboard.json",
        "helm-values.yaml",
        "monitoring.yaml",
        "serving.yaml",
        "workflow.yaml",
    ]
    assert kinds(out / "monitoring.yaml") == ["ConfigMap"]
    dashboard = json.loads((out / "grafana-dashboard.json").read_text())
    assert dashboard["uid"] == "modelship-serving" and len(dashboard["panels"]) > 20
    assert kinds(out / "workflow.yaml") == ["Workflow"]
    assert "HorizontalPodAutoscaler" in kinds(out / "serving.yaml")
    assert "serving.yaml: 2 Deployment, 2 Service" in result.output


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--serving", "kserve"], "InferenceService"),
        (["--serving", "deployment", "--autoscaler", "keda"], "ScaledObject"),
    ],
)
def test_render_flags_override_the_config(tmp_path: Path, flags: list[str], expected: str) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text("deploy:\n  serving:\n    kind: deployment\n    max_replicas: 7\n")
    result = invoke("render", "--config", config, "--out", tmp_path / "out", *flags)
    assert result.exit_code == 0, result.output
    assert expected in kinds(tmp_path / "out" / "serving.yaml")
    assert "max_replicas" not in result.output
    assert "7" in (tmp_path / "out" / "serving.yaml").read_text()


def test_broken_config_names_the_field_and_writes_nothing(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text("deploy:\n  serving:\n    min_replicas: 4\n    max_replicas: 2\n")
    out = tmp_path / "nested" / "out"
    result = invoke("render", "--config", config, "--out", out)

    assert result.exit_code == 2  # a configuration error, as for every command
    assert f"{config}: deploy.serving.max_replicas: max_replicas 2 is below" in result.output
    assert not out.exists() and not out.parent.exists()


def test_render_problem_writes_nothing(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text("deploy:\n  serving:\n    gpu: {count: 1}\n")
    result = invoke("render", "--config", config, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert "serve.engine.device" in result.output
    assert list(tmp_path.iterdir()) == [config]


def test_rerender_replaces_a_previous_render_whole(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert invoke("render", "--out", out).exit_code == 0
    (out / "stale.yaml").write_text("kind: Leftover\n")
    result = invoke("render", "--out", out, "--serving", "kserve")
    assert result.exit_code == 0, result.output
    assert not (out / "stale.yaml").exists() and not (out / "helm-values.yaml").exists()
    assert "InferenceService" in kinds(out / "serving.yaml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp siblings left


def test_refuses_to_replace_a_folder_that_is_not_a_render(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    result = invoke("render", "--out", tmp_path)
    assert result.exit_code == 2
    assert "not a previous render" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_validate_a_render(tmp_path: Path, schema_dir: Path) -> None:
    out = tmp_path / "out"
    assert invoke("render", "--out", out, "--autoscaler", "keda").exit_code == 0
    result = invoke("validate", out, "--schemas", schema_dir)
    assert result.exit_code == 0, result.output
    assert "19 objects" in result.output and ": 0 errors" in result.output
    assert "1 Namespace" in result.output
    assert "Kubernetes 1.33.0" in result.output


def test_validate_fails_on_a_broken_render(tmp_path: Path, schema_dir: Path) -> None:
    out = tmp_path / "out"
    assert invoke("render", "--out", out).exit_code == 0
    serving = out / "serving.yaml"
    serving.write_text(serving.read_text().replace("readinessProbe:", "readynessProbe:", 1))
    result = invoke("validate", out, "--schemas", schema_dir)
    assert result.exit_code == 1
    assert "readynessProbe" in result.output and "1 errors" in result.output


def test_a_device_the_engine_does_not_take_fails_render(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text("serve:\n  engine:\n    device: gpu\n")
    result = invoke("render", "--config", config, "--out", tmp_path / "out")
    assert result.exit_code == 2
    error = "serve.engine.device: device must be cpu, cuda, cuda:N or auto, got 'gpu'"
    assert error in result.output
    assert not (tmp_path / "out").exists()


def test_validate_fails_on_a_device_the_engine_does_not_take(
    tmp_path: Path, schema_dir: Path
) -> None:
    out = tmp_path / "out"
    assert invoke("render", "--out", out).exit_code == 0
    serving = out / "serving.yaml"
    serving.write_text(
        serving.read_text().replace("- --device\n        - cpu", "- --device\n        - gpu", 1)
    )
    result = invoke("validate", out, "--schemas", schema_dir)
    assert result.exit_code == 1
    assert "args: device must be cpu, cuda, cuda:N or auto, got 'gpu'" in result.output
