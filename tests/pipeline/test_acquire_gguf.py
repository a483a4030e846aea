"""The demo model: GGUF -> safetensors conversion keeps the logits of transformers' GGUF load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modelship.pipeline.acquire import DEMO_SLUG, acquire, demo_gguf_path
from modelship.storage import Storage, verify_artifact


@pytest.mark.slow
def test_demo_conversion_keeps_logits(demo_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = demo_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    converted = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    config = json.loads((demo_model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    assert tokenizer.chat_template, "the chat template must survive the conversion"
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = direct(ids).logits
        actual = converted(ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    assert tokenizer.decode(actual[0, -1].argmax()) == tokenizer.decode(expected[0, -1].argmax())


@pytest.mark.slow
def test_demo_is_memoized_with_full_checksums(demo_storage: Storage) -> None:
    base = demo_storage.base_dir(DEMO_SLUG)
    manifest = verify_artifact(base, full=True)
    assert manifest.kind == "base"
    assert manifest.extra["source_kind"] == "demo"
    assert manifest.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "transformers" in manifest.tool_versions and "gguf" in manifest.tool_versions
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= {
        f.path for f in manifest.files
    }
    again = acquire("demo", demo_storage)
    assert again.memoized and again.manifest.created_at == manifest.created_at
