"""Optimize stage: variants published through the storage contract, memoized, typed errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelship.pipeline.acquire import acquire
from modelship.pipeline.errors import PipelineError
from modelship.pipeline.optimize import create_scheme, optimize
from modelship.storage import Storage, verify_artifact
from modelship.storage.manifest import sha256_file

# variants made anew, over a minute in CI: handed to a worker first (tests/conftest.py)
pytestmark = pytest.mark.long


@pytest.fixture
def storage(tiny_llama_dir: Path, tmp_path: Path) -> Storage:
    storage = Storage(tmp_path / "data")
    acquire(str(tiny_llama_dir), storage, name="tiny")
    return storage


def test_fp16_variant_is_published_and_memoized(storage: Storage) -> None:
    [result] = optimize(storage, "tiny", ["fp16"], max_parallel=1)
    assert not result.memoized
    manifest = verify_artifact(result.path, full=True)
    assert manifest.kind == "optimized" and manifest.extra["variant"] == "fp16"
    assert json.loads((result.path / "config.json").read_text())["dtype"] == "float16"
    assert (result.path / "tokenizer.json").is_file()

    [again] = optimize(storage, "tiny", ["fp16"], max_parallel=1)
    assert again.memoized
    assert verify_artifact(again.path).created_at == manifest.created_at


def test_errors_name_the_problem(storage: Storage) -> None:
    with pytest.raises(PipelineError, match=r"unknown optimization scheme 'int3'.*awq, fp16"):
        create_scheme("int3")
    with pytest.raises(PipelineError, match="group size 48 does not divide"):
        optimize(storage, "tiny", ["gptq"], overrides={"gptq": {"group_size": 48}})
    assert not storage.variant_dir("tiny", "gptq").exists()


SMALL_GPTQ = {"gptq": {"num_calibration_samples": 8, "max_seq_length": 128}}


def test_gptq_is_byte_identical_whatever_the_thread_count(tiny_llama_dir: Path, tmp_path: Path):
    """Two torch threads gave other weights than one about one run in two before the
    calibration was pinned to one thread; now every file is the same."""
    files = []
    for threads in (2, 1):
        storage = Storage(tmp_path / f"data-{threads}")
        acquire(str(tiny_llama_dir), storage, name="tiny")
        [result] = optimize(
            storage, "tiny", ["gptq"], max_parallel=1, num_threads=threads, overrides=SMALL_GPTQ
        )
        files.append({entry.path: entry.sha256 for entry in verify_artifact(result.path).files})
    assert files[0] == files[1]


def test_verify_rebuild_makes_a_variant_again_and_compares_bytes(storage: Storage) -> None:
    from test_cli import run_cli

    [result] = optimize(storage, "tiny", ["gptq"], max_parallel=1, overrides=SMALL_GPTQ)
    same = run_cli("verify", str(result.path), "--rebuild")
    assert same.returncode == 0 and "byte-identical" in same.stdout, same.stderr
    assert not list(result.path.parent.glob(".rebuild-*"))  # the scratch folder is gone

    # As if the published bytes had come from a nondeterministic run: a file and its
    # manifest entry both changed (the artifact itself stays intact).
    config = result.path / "config.json"
    config.write_text(config.read_text() + "\n")
    manifest = json.loads((result.path / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == "config.json":
            entry["size"] = config.stat().st_size
            entry["sha256"] = sha256_file(config)
    (result.path / "manifest.json").write_text(json.dumps(manifest))
    differs = run_cli("verify", str(result.path), "--rebuild")
    assert differs.returncode == 1
    assert "1 of" in differs.stderr and "config.json" in differs.stderr

    fp16 = optimize(storage, "tiny", ["fp16"], max_parallel=1)[0].path
    storage_base = run_cli("verify", str(storage.base_dir("tiny")), "--rebuild")
    assert storage_base.returncode == 1 and "not an optimized variant" in storage_base.stderr
    assert run_cli("verify", str(fp16), "--rebuild").returncode == 0
