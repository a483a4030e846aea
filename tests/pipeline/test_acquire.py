"""Acquire from a local folder, the Hub (a local stand-in), and bad sources."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelship.pipeline.acquire import acquire, resolve_source
from modelship.pipeline.errors import AcquireError
from modelship.storage import Storage, verify_artifact

from hub_stand_in import HubStandIn

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    return Storage(tmp_path / "data")


@pytest.fixture
def hub(tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    newer = tmp_path / "newer"
    shutil.copytree(tiny_llama_dir, newer)
    config = json.loads((newer / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (newer / "config.json").write_text(json.dumps(config))
    (tiny_llama_dir / "README.md").write_text("not downloaded: not in the allow-patterns")

    stand_in = HubStandIn()
    stand_in.add_folder("acme/tiny", COMMIT_A, tiny_llama_dir, refs=["v1"])
    stand_in.add_folder("acme/tiny", COMMIT_B, newer, refs=["main"])
    stand_in.add_folder("acme/gated", COMMIT_A, tiny_llama_dir, refs=["main"])
    stand_in.repos["acme/gated"].gated = True
    stand_in.start()
    monkeypatch.setenv("HF_ENDPOINT", stand_in.endpoint)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    yield stand_in
    stand_in.stop()
    (tiny_llama_dir / "README.md").unlink()


def test_the_base_shares_no_file_with_the_source(
    tiny_llama_dir: Path, storage: Storage, tmp_path: Path
) -> None:
    """The base is a copy: a weights file truncated in storage leaves the user's folder
    whole (a hard link would cut both), and the next acquire makes a whole base again."""
    source = tmp_path / "source"
    shutil.copytree(tiny_llama_dir, source)
    base = acquire(str(source), storage, name="tiny").path
    for path in base.iterdir():
        if (source / path.name).is_file():
            assert not (source / path.name).samefile(path), path.name
    size = (source / "model.safetensors").stat().st_size
    with open(base / "model.safetensors", "r+b") as handle:
        handle.truncate(size // 2)
    assert (source / "model.safetensors").stat().st_size == size
    again = acquire(str(source), storage, name="tiny")
    assert not again.memoized
    assert (again.path / "model.safetensors").stat().st_size == size
    verify_artifact(again.path, full=True)


def test_local_folder_is_validated_and_copied(tiny_llama_dir: Path, storage: Storage) -> None:
    result = acquire(str(tiny_llama_dir), storage, name="tiny")
    assert result.path == storage.base_dir("tiny")
    manifest = verify_artifact(result.path, full=True)
    names = {f.path for f in manifest.files}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert manifest.source == str(tiny_llama_dir.resolve())
    assert not result.memoized

    again = acquire(str(tiny_llama_dir), storage, name="tiny")
    assert again.memoized
    assert again.manifest.created_at == manifest.created_at


def test_non_model_folder_names_what_is_missing(tmp_path: Path, storage: Storage) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(AcquireError, match=r"missing \*\.safetensors weights, a tokenizer"):
        acquire(str(folder), storage)
    assert not storage.base_dir("notes").exists()


def test_corrupt_gguf_gets_one_line_reason(tmp_path: Path, storage: Storage) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(AcquireError, match=r"broken\.gguf: not a GGUF file"):
        acquire(str(bad), storage)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + b"\3\0\0\0" + b"\0" * 8)
    with pytest.raises(AcquireError, match=r"truncated\.gguf: cannot be converted"):
        acquire(str(truncated), storage)
    assert not (storage.root / "models" / "truncated" / "base").exists()


def test_source_resolution_errors(tmp_path: Path) -> None:
    with pytest.raises(AcquireError, match="no such file or folder"):
        resolve_source(str(tmp_path / "missing.gguf"))
    with pytest.raises(AcquireError, match=r"must be a \.gguf file"):
        (tmp_path / "x.bin").write_bytes(b"1")
        resolve_source(str(tmp_path / "x.bin"))
    assert resolve_source("Org/Model-1").slug == "org--model-1"


def test_hub_download_pins_revision_and_memoizes(hub: HubStandIn, storage: Storage) -> None:
    pinned = acquire("acme/tiny", storage, revision="v1")
    assert pinned.manifest.revision == COMMIT_A
    assert pinned.manifest.source == "hf://acme/tiny"
    assert "README.md" not in {f.path for f in pinned.manifest.files}
    config = json.loads((pinned.path / "config.json").read_text())
    assert config["rms_norm_eps"] != 1e-5

    latest = acquire("acme/tiny", storage)  # main moved on: a new base replaces the old
    assert latest.manifest.revision == COMMIT_B
    assert json.loads((latest.path / "config.json").read_text())["rms_norm_eps"] == 1e-5

    seen = len(hub.requests)
    again = acquire("acme/tiny", storage)
    assert again.memoized and again.manifest.revision == COMMIT_B
    assert len(hub.requests) == seen, "a memoized acquire must not touch the network"

    by_sha = acquire("acme/tiny", storage, revision=COMMIT_B)
    assert by_sha.memoized and len(hub.requests) == seen


def test_hub_errors_are_one_line(hub: HubStandIn, storage: Storage) -> None:
    with pytest.raises(AcquireError, match="'acme/missing' not found on the Hub"):
        acquire("acme/missing", storage)
    with pytest.raises(AcquireError, match="revision 'nope' not found in acme/tiny"):
        acquire("acme/tiny", storage, revision="nope")
    with pytest.raises(AcquireError, match="acme/gated is gated"):
        acquire("acme/gated", storage)
    assert not (storage.root / "models").exists() or not any(
        (storage.root / "models").glob("*/base")
    )


def test_unreachable_hub_fails_fast_with_advice(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    # Bound, never listening, until the end: connections are refused, and no other process
    # (a test in another pytest-xdist worker) can listen there meanwhile.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
        with pytest.raises(AcquireError) as info:
            acquire("acme/tiny", storage)
    message = str(info.value)
    assert "cannot reach the Hugging Face Hub" in message
    assert "modelship acquire demo" in message
    assert "\n" not in message
