"""`modelship serve` as a vLLM user reaches for it: a help that reads at 80 columns. Real
subprocesses."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import typer

from modelship.cli import app as cli_app


def run_cli(*args: str, columns: int = 200, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "modelship", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": str(columns), **env},
    )


# Help -----------------------------------------------------------------------------------------
def test_serve_help_fits_80_columns_with_every_flag_whole() -> None:
    result = run_cli("serve", "--help", columns=80)
    assert result.returncode == 0
    text = result.stdout
    assert max(map(len, text.splitlines())) <= 80
    command = typer.main.get_command(cli_app).commands["serve"]  # type: ignore[attr-defined]
    for param in command.params:  # each sense's first spelling; aliases in the help text
        for opts in (param.opts, param.secondary_opts):
            flag = next((opt for opt in opts if opt.startswith("--")), None)
            if flag is not None:
                assert re.search(rf"(^|[\s/,]){re.escape(flag)}(\s|$)", text, re.M), flag
    assert not re.search(r"<(bool|str|int|float|path|list)", text)  # no Python type names
    for panel in ("Model", "Server", "Engine", "Scheduling", "Speculative decoding", "LoRA",
                  "Limits", "Observability"):  # fmt: skip
        assert f"\n{panel}:\n" in text, panel
    assert run_cli("serve", "-h", columns=80).stdout == text


def test_short_help_and_version_at_the_top() -> None:
    assert run_cli("-h").returncode == 0
    version = run_cli("--version")
    assert version.returncode == 0
    assert re.fullmatch(r"modelship \d+\.\d+\.\d+\S*\n", version.stdout)
