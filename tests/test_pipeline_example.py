"""The shipped pipeline.example.yaml loads with modelship's own config loader and says true
things: every top-level section is in it, and its values are the defaults it claims."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from modelship.cli import app
from modelship.config import ModelshipConfig

EXAMPLE = Path(__file__).resolve().parents[1] / "pipeline.example.yaml"


def test_the_example_loads_with_the_real_loader() -> None:
    config = ModelshipConfig.load(EXAMPLE)
    assert config.source == "demo"


def test_the_example_names_every_top_level_section() -> None:
    keys = set(yaml.safe_load(EXAMPLE.read_text()))
    assert keys == set(ModelshipConfig.model_fields), "add the new section to the example"


def test_the_example_values_are_the_defaults_as_its_header_says() -> None:
    loaded = ModelshipConfig.load(EXAMPLE).model_dump(mode="json")
    assert loaded == ModelshipConfig().model_dump(mode="json")


def test_the_cli_accepts_the_example(tmp_path: Path) -> None:
    out = tmp_path / "k8s"
    result = CliRunner().invoke(
        app, ["deploy", "render", "--config", str(EXAMPLE), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert (out / "cluster.yaml").is_file()
