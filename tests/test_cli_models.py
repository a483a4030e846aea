"""Which model the commands act on (the one in storage, not the demo), `modelship list`,
and what the commands say of a model with nothing yet, through the real command line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from modelship.pipeline.acquire import acquire
from modelship.storage import Storage

from fleet_storage import publish_release, publish_variant


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "modelship", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.fixture
def one_model(tiny_llama_dir: Path, tmp_path: Path) -> Storage:
    """Storage holding only `my-model`: its base, an fp16 variant and release 1 (production)."""
    storage = Storage(tmp_path / "data")
    acquire(str(tiny_llama_dir), storage, name="my-model")
    publish_variant(storage, "my-model", tiny_llama_dir, "fp16")
    storage.set_production("my-model", publish_release(storage, "my-model", tiny_llama_dir, "fp16"))
    return storage


def test_commands_act_on_the_only_model_in_storage(one_model: Storage) -> None:
    root = str(one_model.root)
    status = run_cli("status", "--storage", root)
    assert status.returncode == 0, status.stderr
    assert "my-model" in status.stdout and "smollm2" not in status.stdout
    assert "releases: 1*" in status.stdout

    release = run_cli("release", "status", "--storage", root)
    assert release.returncode == 0, release.stderr
    assert "production: release 1" in release.stdout


def test_several_models_are_named_and_model_is_asked_for(
    one_model: Storage, tiny_llama_dir: Path
) -> None:
    acquire(str(tiny_llama_dir), one_model, name="other-model")
    result = run_cli("status", "--storage", str(one_model.root))
    assert result.returncode == 2
    assert "my-model, other-model" in result.stderr and "--model" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

    named = run_cli("status", "--storage", str(one_model.root), "--model", "other-model")
    assert named.returncode == 0 and "releases: none" in named.stdout


def test_a_mistyped_model_gets_a_did_you_mean(one_model: Storage) -> None:
    result = run_cli("status", "--storage", str(one_model.root), "--model", "my-modle")
    assert result.returncode == 2
    assert "did you mean --model my-model?" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_storage_folder_is_an_error_with_the_fix(tmp_path: Path) -> None:
    for command in (["status"], ["release", "status"], ["rollback"], ["list"]):
        result = run_cli(*command, "--storage", str(tmp_path / "nowhere"))
        assert result.returncode == 2, command
        assert "no such storage folder" in result.stderr and "--storage" in result.stderr


def test_empty_storage_says_how_to_make_a_model(tmp_path: Path) -> None:
    status = run_cli("status", "--storage", str(tmp_path))
    assert status.returncode == 1
    assert "no model under" in status.stderr and "modelship run" in status.stderr
    listed = run_cli("list", "--storage", str(tmp_path))
    assert listed.returncode == 0 and "no model under" in listed.stdout


def test_list_shows_models_releases_production_and_what_serves(
    one_model: Storage, tiny_llama_dir: Path
) -> None:
    from modelship.fleet.serving_record import clear_serving, write_serving

    acquire(str(tiny_llama_dir), one_model, name="other-model")
    # What `modelship up` writes before it listens; this process stands in for it (alive).
    write_serving(one_model, "my-model", "http://127.0.0.1:8080/v1")
    try:
        table = run_cli("list", "--storage", str(one_model.root))
        listed = run_cli("list", "--json", "--storage", str(one_model.root))
    finally:
        clear_serving(one_model, "my-model")
    assert table.returncode == 0, table.stderr
    mine = next(line for line in table.stdout.splitlines() if line.strip().startswith("my-model"))
    assert "release 1 (fp16)" in mine and "http://127.0.0.1:8080/v1" in mine
    rows = {row["model"]: row for row in json.loads(listed.stdout)}
    assert rows["my-model"]["production"] == 1 and rows["my-model"]["variants"] == ["fp16"]
    assert rows["other-model"] == rows["other-model"] | {"releases": [], "production": None}
    assert rows["other-model"]["serving"] is None

    # A record left by an `up` that was killed reads as not serving.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    path = one_model.model_dir("my-model") / "fleet" / "up.json"
    path.write_text(json.dumps({"url": "http://127.0.0.1:1/v1", "pid": int(gone.stdout),
                                "hostname": socket.gethostname(), "started_at": "x"}))  # fmt: skip
    after = json.loads(run_cli("list", "--json", "--storage", str(one_model.root)).stdout)
    assert next(r for r in after if r["model"] == "my-model")["serving"] is None


def test_select_with_nothing_optimized_is_one_line_with_the_fix(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    storage = Storage(tmp_path)
    acquire(str(tiny_llama_dir), storage, name="my-model")
    result = run_cli("select", "--storage", str(tmp_path))
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines == [lines[-1]] and "nothing to select from" in lines[0]
    assert "modelship optimize" in lines[0]


def test_a_model_without_releases_reads_without_python_values(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    acquire(str(tiny_llama_dir), Storage(tmp_path), name="my-model")
    release = run_cli("release", "status", "--storage", str(tmp_path))
    assert release.returncode == 0, release.stderr
    assert "production: none (my-model has no release yet: `modelship select`" in release.stdout
    rollback = run_cli("rollback", "--storage", str(tmp_path))
    assert rollback.returncode == 1
    assert "my-model has no release yet" in rollback.stderr
    for result in (release, rollback):
        assert "None" not in result.stdout + result.stderr


def test_status_shows_memoized_as_yes_or_no(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from modelship.pipeline.dag import DAG, Step
    from modelship.pipeline.run import run_dir

    storage = Storage(tmp_path)
    acquire(str(tiny_llama_dir), storage, name="my-model")
    steps = [
        Step("acquire", lambda ctx: {"memoized": True}),
        Step("optimize-fp16", lambda ctx: {"memoized": False}, after=("acquire",)),
    ]
    DAG(steps, run_dir(storage, "my-model")).run()
    result = run_cli("status", "--storage", str(tmp_path))
    assert result.returncode == 0, result.stderr
    cells = [line.strip("│ ").split("│") for line in result.stdout.splitlines() if "│" in line]
    rows = {row[0].strip(): [cell.strip() for cell in row] for row in cells}
    assert "yes" in rows["acquire"] and "no" in rows["optimize-fp16"]
    assert "True" not in result.stdout and "False" not in result.stdout


def test_rollback_to_the_production_release_refuses_and_writes_nothing(
    one_model: Storage,
) -> None:
    result = run_cli("rollback", "--to", "1", "--storage", str(one_model.root))
    assert result.returncode == 1
    assert "release 1 is already production; nothing changed" in result.stderr
    assert "->" not in result.stdout
    assert not (one_model.model_dir("my-model") / "traffic.json").exists()  # no history event


def test_a_failed_acquire_leaves_nothing_behind(tmp_path: Path) -> None:
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "notes.txt").write_text("no weights here")
    storage = tmp_path / "data"
    result = run_cli("acquire", str(folder), "--storage", str(storage))
    assert result.returncode == 1 and "not a model folder" in result.stderr
    assert list((storage / "models").iterdir()) == []  # no .base.lock, no empty model folder


def test_steps_missing_before_a_command_are_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    publish_release(storage, "released-only", tiny_llama_dir, "fp16")  # no base to optimize
    optimize = run_cli("optimize", "--storage", str(tmp_path))
    assert optimize.returncode == 1
    assert "released-only has no base model" in optimize.stderr
    assert "modelship acquire SOURCE --name released-only" in optimize.stderr

    acquire(str(tiny_llama_dir), storage, name="base-only")  # nothing to serve
    up = run_cli("up", "--storage", str(tmp_path), "--model", "base-only")
    assert up.returncode == 1
    assert "base-only has no production release" in up.stderr
    assert "modelship optimize --model base-only" in up.stderr
    publish_variant(storage, "base-only", tiny_llama_dir, "fp16")  # optimized, not selected
    up = run_cli("up", "--storage", str(tmp_path), "--model", "base-only")
    assert up.returncode == 1
    assert "variants (fp16) are optimized" in up.stderr
    assert "modelship select --model base-only" in up.stderr

    verify = run_cli("verify", str(tmp_path / "nowhere"))
    assert verify.returncode == 1 and "no such folder" in verify.stderr
