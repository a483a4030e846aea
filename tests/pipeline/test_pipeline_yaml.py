"""pipeline.yaml: defaults, and errors that name the field (CLI exit code 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from modelship.cli import app
from modelship.config import ConfigError, ModelshipConfig


def test_defaults_run_the_demo_with_the_three_variants() -> None:
    config = ModelshipConfig.load(None)
    assert config.source == "demo"
    assert config.optimize.variants == ["fp16", "awq", "gptq"]
    assert config.select.preset == "default" and config.select.gates.min_quality_share == 0.9


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("optimize:\n  variants: [fp16, fp8]\n", "optimize.variants: unknown variant 'fp8'"),
        ("select:\n  concurrency: 0\n", "select.concurrency: Input should be greater"),
        ("select:\n  weights: {speed: 1}\n", "select.weights.speed"),
        ("select:\n  gates: {min_quality_share: 2}\n", "select.gates.min_quality_share"),
        ("serve:\n  prot: 80\n", "serve.prot: Extra inputs are not permitted"),
        ("select: [1, 2\n", "not valid YAML"),
        ("- a list\n", "top level must be a mapping"),
    ],
)
def test_errors_name_the_field(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"pipeline\.yaml") as info:
        ModelshipConfig.load(path)
    assert fragment in str(info.value)


def test_cli_reports_config_errors_with_exit_code_2(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text("optimize:\n  max_parallel: -1\n")
    result = CliRunner().invoke(app, ["run", "--no-serve", "--config", str(path)])
    assert result.exit_code == 2
    assert "optimize.max_parallel" in result.output
    missing = CliRunner().invoke(app, ["status", "--config", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "no such config file" in missing.output


def test_every_yaml_example_in_the_readme_and_docs_is_a_valid_config() -> None:
    import re

    import yaml

    root = Path(__file__).resolve().parents[2]
    # docs/kubernetes.md's blocks include other tools' objects (a ServiceMonitor...).
    pages = ["README.md", "docs/gateway.md", "docs/pipeline.md", "docs/serving.md"]
    checked = 0
    for page in pages:
        blocks = re.findall(r"```yaml\n(.*?)```", (root / page).read_text(), re.S)
        for block in blocks:
            ModelshipConfig.from_dict(yaml.safe_load(block), page)
        checked += len(blocks)
    assert checked >= 6
