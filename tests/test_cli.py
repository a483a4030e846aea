"""The `modelship` command line: exit codes and messages, run as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "modelship", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def test_help_lists_commands() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert "acquire" in result.stdout and "verify" in result.stdout


def test_acquire_local_then_verify(tiny_llama_dir: Path, tmp_path: Path) -> None:
    result = run_cli("acquire", str(tiny_llama_dir), "--name", "tiny", "--storage", str(tmp_path))
    assert result.returncode == 0, result.stderr
    base = tmp_path / "models" / "tiny" / "base"
    assert str(base) in result.stdout.replace("\n", "")

    again = run_cli("acquire", str(tiny_llama_dir), "--name", "tiny", "--storage", str(tmp_path))
    assert again.returncode == 0 and "memoized" in again.stdout

    verified = run_cli("verify", str(base), "--full")
    assert verified.returncode == 0 and "match (sha256)" in verified.stdout

    # A new file, not a write through the hard link acquire made to the shared tiny model.
    (base / "tokenizer.json").unlink()
    (base / "tokenizer.json").write_text("{}")
    broken = run_cli("verify", str(base))
    assert broken.returncode == 1
    assert "tokenizer.json" in broken.stderr and "Traceback" not in broken.stderr


def test_storage_from_environment(tiny_llama_dir: Path, tmp_path: Path) -> None:
    result = run_cli(
        "acquire", str(tiny_llama_dir), "--name", "t2", env={"MODELSHIP_STORAGE": str(tmp_path)}
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "models" / "t2" / "base" / "manifest.json").is_file()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("./does/not/exist", "no such file or folder"),
        ("not a repo!", "not a Hub repo id"),
    ],
)
def test_bad_sources_exit_1_with_one_line(source: str, message: str, tmp_path: Path) -> None:
    result = run_cli("acquire", source, "--storage", str(tmp_path))
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_offline_hub_message(tmp_path: Path) -> None:
    result = run_cli(
        "acquire",
        "acme/tiny",
        "--storage",
        str(tmp_path),
        env={"HF_ENDPOINT": "http://127.0.0.1:9"},
    )
    assert result.returncode == 75  # transient: a workflow engine retries the step
    assert "cannot reach the Hugging Face Hub" in result.stderr
    assert "demo" in result.stderr


def test_revision_on_a_local_folder_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    result = run_cli("acquire", str(tiny_llama_dir), "--revision", "v1", "--storage", str(tmp_path))
    assert result.returncode == 1
    assert "--revision applies to Hub repos only" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("serve", "./no-such-folder"),  # does not exist
        ("serve", "."),  # not a model folder
        ("serve", ".", "--block-size", "0"),  # an impossible engine option
        ("gateway",),  # no replicas to route to
        ("up", "--config", "no-such-pipeline.yaml"),
        ("release", "status", "--config", "no-such-pipeline.yaml"),
        ("deploy", "render", "--out", "x", "--config", "no-such-pipeline.yaml"),
    ],
)
def test_configuration_errors_exit_2_in_every_command_group(args, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "modelship", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200", "MODELSHIP_GATEWAY_ENDPOINTS": ""},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "error" in result.stderr.lower()
    assert "Traceback" not in result.stderr


def test_a_device_the_engine_does_not_take_is_one_line(tiny_llama_dir: Path) -> None:
    result = run_cli("serve", str(tiny_llama_dir), "--device", "gpu")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --device: device must be cpu, cuda, cuda:N or auto, got 'gpu' (a GPU is `cuda`)"
    ]


def test_a_device_this_torch_cannot_use_is_one_line(tiny_llama_dir: Path) -> None:
    import torch

    # A CPU build: CUDA at all; a CUDA build: a device index past the last one.
    device = "cuda" if torch.version.cuda is None else "cuda:99"
    result = run_cli("serve", str(tiny_llama_dir), "--device", device)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --device {device}: ")
    assert "--device cpu" in line or "visible" in line
