"""`modelship serve` as a vLLM user reaches for it: the port checked before the model loads,
and a help that reads at 80 columns. Real subprocesses."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import typer

from modelship.cli import app as cli_app
from modelship.cli.serve import PORT_IN_USE_EXIT_CODE


def run_cli(*args: str, columns: int = 200, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "modelship", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": str(columns), **env},
    )


# The port -------------------------------------------------------------------------------------
def test_a_port_out_of_range_is_refused(tiny_llama_dir: Path) -> None:
    result = run_cli("serve", str(tiny_llama_dir), "--port", "70000")
    assert result.returncode == 2
    assert "--port" in result.stderr and "65535" in result.stderr


def test_a_busy_port_fails_before_the_model_loads(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # Weights that cannot load: a server that loaded the model before binding fails on them.
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"\0" * 64)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("serve", str(broken), "--port", str(port))
    assert result.returncode == PORT_IN_USE_EXIT_CODE, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: 127.0.0.1:{port} is in use: stop what listens there or pass --port with a "
        "free port"
    ]


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
