"""Optimize stage: variants published through the storage contract, memoized, typed errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelship.pipeline.acquire import acquire
from modelship.pipeline.errors import PipelineError
from modelship.pipeline.optimize import create_scheme, optimize
from modelship.storage import Storage, verify_artifact


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
