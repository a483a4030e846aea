"""Shared fixtures: tiny random models and the demo model, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelship.storage import Storage

from tiny_models import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="session")
def demo_storage(tmp_path_factory: pytest.TempPathFactory) -> Storage:
    """A storage root holding the acquired demo model (the GGUF conversion runs once)."""
    from modelship.pipeline.acquire import acquire

    storage = Storage(tmp_path_factory.mktemp("demo-storage"))
    acquire("demo", storage)
    return storage


@pytest.fixture(scope="session")
def demo_model_dir(demo_storage: Storage) -> Path:
    from modelship.pipeline.acquire import DEMO_SLUG

    return demo_storage.base_dir(DEMO_SLUG)


@pytest.fixture(scope="session")
def demo_int4_dir(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model quantized with llm-compressor's round-to-nearest W4A16 at group size 64
    (seconds): the layout the optimize stage writes, on the W4A8 kernel."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}
    modifier = QuantizationModifier(
        targets="Linear",
        ignore=["lm_head"],
        config_groups={"g": {"targets": ["Linear"], "weights": weights | {"symmetric": True}}},
    )
    oneshot(model=model, recipe=[modifier])
    out = tmp_path_factory.mktemp("demo-int4")
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(demo_model_dir).save_pretrained(out)
    for name in ("generation_config.json",):
        if (demo_model_dir / name).exists():
            (out / name).write_bytes((demo_model_dir / name).read_bytes())
    return out
