"""docs/cli-reference.md is what the CLI says about itself today (regenerate it with
`python -m modelship.cli.reference > docs/cli-reference.md` after changing a command)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from modelship.cli import app
from modelship.cli.reference import cli_reference

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "cli-reference.md"


def test_the_committed_reference_matches_the_cli() -> None:
    assert REFERENCE.read_text() == cli_reference(app), (
        "docs/cli-reference.md is stale: python -m modelship.cli.reference > docs/cli-reference.md"
    )


def test_every_command_and_option_has_a_section_or_row() -> None:
    import typer

    text = REFERENCE.read_text()
    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="modelship")
    for name in root.list_commands(ctx):
        command = root.get_command(ctx, name)
        if command.hidden:
            continue
        assert f"## modelship {name}\n" in text
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                assert f"`{param.opts[0]}" in text or f", {param.opts[0]}" in text


def test_the_module_prints_the_reference() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "modelship.cli.reference"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed == REFERENCE.read_text()
    # Every table row has as many cells as its header: no help text split a row with a pipe.
    for table in re.findall(r"((?:^\|.*\|\n)+)", printed, re.M):
        rows = table.splitlines()
        widths = {len(re.split(r"(?<!\\)\|", row)) for row in rows}
        assert len(widths) == 1, rows
