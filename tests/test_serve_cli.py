"""`modelship serve` as a vLLM user reaches for it: what MODEL may be, vLLM's spellings of
the engine flags, the KV cache and port checked before the model loads, and a help that
reads at 80 columns. Real subprocesses and real servers on 127.0.0.1."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import typer

from modelship.cli import app as cli_app
from modelship.cli.serve import FLAGS, PORT_IN_USE_EXIT_CODE, serve_options
from modelship.cli.serve import app as serve_app
from modelship.server.process import bind_socket
from modelship.storage import Storage

from fleet_storage import publish_release
from hub_stand_in import HubStandIn
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(300)

SMALL = ("--max-model-len", "256", "--kv-cache-memory-mb", "16")


def run_cli(
    *args: str, columns: int = 200, pass_fds: tuple[int, ...] = (), **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "modelship", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": str(columns), **env},
        pass_fds=pass_fds,
    )


def served(process: ServerProcess) -> tuple[str, str]:
    """(the model id /v1/models lists, the variant /ready names)."""
    models = httpx.get(f"{process.url}/v1/models").json()["data"]
    return models[0]["id"], httpx.get(f"{process.url}/ready").json()["variant"]


# MODEL ----------------------------------------------------------------------------------------
@pytest.fixture
def storage_with_release(tiny_llama_dir: Path, tmp_path: Path) -> Storage:
    """`tiny-chat` in storage with its fp16 release in production, as `select` leaves it."""
    storage = Storage(tmp_path / "data")
    number = publish_release(storage, "tiny-chat", tiny_llama_dir, "fp16")
    storage.set_production("tiny-chat", number)
    return storage


def test_a_release_is_served_by_its_models_slug_and_labelled_with_its_variant(
    storage_with_release: Storage,
) -> None:
    # Before: `production/` served as model "1" (the release folder's name) labelled base.
    production = storage_with_release.production_link("tiny-chat")
    process = ServerProcess(production, *SMALL)
    try:
        assert served(process) == ("tiny-chat", "fp16")
    finally:
        process.stop()
    # The slug alone serves the same release.
    process = ServerProcess(Path("tiny-chat"), "--storage", str(storage_with_release.root), *SMALL)
    try:
        assert served(process) == ("tiny-chat", "fp16")
    finally:
        process.stop()


def test_a_hub_id_is_acquired_then_served(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = HubStandIn()
    hub.add_folder("acme/tiny", "c" * 40, tiny_llama_dir, refs=["main"])
    hub.start()
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    storage = Storage(tmp_path / "data")
    try:
        process = ServerProcess(Path("acme/tiny"), "--storage", str(storage.root), *SMALL)
        try:
            assert served(process) == ("acme--tiny", "base")
        finally:
            process.stop()
    finally:
        hub.stop()
    assert (storage.base_dir("acme--tiny") / "manifest.json").is_file()  # through acquire


def test_an_unreachable_hub_is_one_line_naming_the_id(tmp_path: Path) -> None:
    result = run_cli(
        "serve", "acme/tiny", "--storage", str(tmp_path), HF_ENDPOINT="http://127.0.0.1:9"
    )
    assert result.returncode == 75, result.stderr  # transient, as `modelship acquire` says
    assert "cannot reach the Hugging Face Hub" in result.stderr and "acme/tiny" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_gguf_file_goes_through_acquire(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    result = run_cli("serve", str(broken), "--storage", str(tmp_path / "data"))
    assert result.returncode == 1, result.stderr
    assert "not a model folder" not in result.stderr  # what serve said of any .gguf before
    assert "Traceback" not in result.stderr
    result = run_cli("serve", str(tmp_path / "notes.txt"))
    assert "does not exist" in result.stderr


def test_what_does_not_exist_says_so_and_lists_the_models_in_storage(
    storage_with_release: Storage, tmp_path: Path
) -> None:
    missing = run_cli("serve", str(tmp_path / "missing"))
    assert missing.returncode == 2
    assert f"{tmp_path / 'missing'} does not exist" in missing.stderr
    typo = run_cli("serve", "tiny-chta", "--storage", str(storage_with_release.root))
    assert typo.returncode == 2
    assert "tiny-chta does not exist" in typo.stderr and "(there: tiny-chat)" in typo.stderr
    assert "Traceback" not in missing.stderr + typo.stderr


# vLLM's spellings -----------------------------------------------------------------------------
def parse(tiny_llama_dir: Path, *args: str):
    command = typer.main.get_command(serve_app)
    context = command.make_context("serve", [str(tiny_llama_dir), *args])
    flags = {spec.param: context.params[spec.param] for spec in FLAGS}
    return serve_options(tiny_llama_dir, flags).engine


def test_vllm_spellings_of_the_engine_flags(tiny_llama_dir: Path) -> None:
    assert parse(tiny_llama_dir, "--no-enable-prefix-caching").prefix_caching is False
    assert parse(tiny_llama_dir, "--enable-prefix-caching").prefix_caching is True
    assert parse(tiny_llama_dir, "--enforce-eager").cuda_graphs is False
    assert parse(tiny_llama_dir, "--dtype", "half").dtype == "float16"
    assert parse(tiny_llama_dir, "--dtype", "auto").dtype is None
    fraction = parse(tiny_llama_dir, "--gpu-memory-utilization", "0.5")
    assert fraction.kv_cache_memory_fraction == 0.5
    assert fraction.to_engine_config().kv_cache_memory_fraction == 0.5
    device = parse(tiny_llama_dir, "--device", "auto").to_engine_config().torch_device
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_kv_cache_that_cannot_hold_one_sequence_is_refused(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    # 1 MiB of fp32 cache holds 2048 tokens of the tiny model: not one 8192-token sequence.
    result = run_cli("serve", str(tiny_llama_dir), "--kv-cache-memory-mb", "1",
                     "--max-model-len", "8192")  # fmt: skip
    assert result.returncode == 2
    assert "fewer than one sequence of max_model_len 8192" in result.stderr
    assert "Traceback" not in result.stderr
    # A share of free memory is known once the weights are in: checked then, as clearly.
    # The port is handed over bound (--fd), so no other test can take it before the server.
    with bind_socket("127.0.0.1") as sock:
        result = run_cli("serve", str(tiny_llama_dir), "--gpu-memory-utilization", "1e-9",
                         "--engine-core", "thread", "--fd", str(sock.fileno()),
                         pass_fds=(sock.fileno(),))  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "fewer than one sequence of max_model_len 512" in result.stderr
    assert "Traceback" not in result.stderr


# The output head -------------------------------------------------------------------------------
def test_a_release_serves_the_head_select_measured_it_with(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from modelship.cli.serve_model import served_folder

    storage = Storage(tmp_path / "data")
    head4 = {"lm_head": "int4"}
    number = publish_release(storage, "tiny-chat", tiny_llama_dir, "gptq-int4head", head4)
    storage.set_production("tiny-chat", number)
    production = storage.production_link("tiny-chat")
    release = served_folder(production)
    assert release.measured_engine == head4
    command = typer.main.get_command(serve_app)

    def engine(*args: str):
        context = command.make_context("serve", [str(production), *args])
        flags = {spec.param: context.params[spec.param] for spec in FLAGS}
        return serve_options(production, flags, measured_engine=release.measured_engine).engine

    assert engine().to_engine_config().lm_head == "int4"  # auto: what was measured
    assert engine("--lm-head", "int8").lm_head == "int8"  # a flag given wins
    assert engine("--lm-head", "dense").lm_head == "dense"
    # a variant folder (no numerics recorded) keeps auto
    assert served_folder(tiny_llama_dir).measured_engine == {}
    # The replica itself: `modelship serve` of the release loads the 4-bit head.
    if cpu_kernels_available():
        process = ServerProcess(production, *SMALL)
        try:
            assert served(process) == ("tiny-chat", "gptq-int4head")
            assert "logits from a 4-bit copy of the output head" in process.log()
        finally:
            process.stop()


def cpu_kernels_available() -> bool:
    from modelship.model import cpu_kernels

    return cpu_kernels.load()


def test_bad_head_values_are_one_line_naming_the_flag(tiny_llama_dir: Path) -> None:
    result = run_cli("serve", str(tiny_llama_dir), "--lm-head", "int2")
    assert result.returncode == 2 and "--lm-head" in result.stderr and "int2" in result.stderr
    result = run_cli("serve", str(tiny_llama_dir), "--lm-head", "int4", "--device", "cuda")
    assert result.returncode == 2, result.stderr
    assert "--lm-head: lm_head int4 runs on modelship's CPU kernels, not on cuda" in result.stderr
    assert "Traceback" not in result.stderr


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
    for alias in ("--enable-prefix-caching", "--enforce-eager", "--gpu-memory-utilization"):
        assert alias in text
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
