"""Our model implementations against transformers on the same tiny random weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modelship.model import AttentionMetadata, UnsupportedModelError, allocate_kv_cache, load_model
from modelship.model.loader import MissingWeightError

BLOCK = 4


def save_tiny(kind: str, folder: Path, **overrides) -> Path:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    settings = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if kind == "qwen3":
        settings["head_dim"] = 32  # explicit, != hidden / heads
    settings.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**settings))
    with torch.no_grad():  # random biases/norms so the extra parts are really exercised
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def reference_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(ids.unsqueeze(0)).logits[0]


def run(model, chunks, block_tables, num_blocks=32):
    """Run sequences' chunks step by step: chunks[step] = [(seq, ids, start)], returns logits."""
    caches = allocate_kv_cache(model.config, num_blocks, BLOCK, torch.float32, "cpu")
    outputs = []
    for step in chunks:
        ids = torch.cat([c[1] for c in step])
        positions = torch.cat([torch.arange(c[2], c[2] + len(c[1])) for c in step])
        meta = AttentionMetadata.build(
            [len(c[1]) for c in step],
            [c[2] + len(c[1]) for c in step],
            [block_tables[c[0]] for c in step],
            BLOCK,
            "cpu",
        )
        with torch.no_grad():
            outputs.append(model.compute_logits(model(ids, positions, caches, meta)))
    return outputs


CASES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    ("qwen2", {}),
    ("qwen3", {}),
]


@pytest.mark.parametrize(("kind", "overrides"), CASES)
def test_logits_match_transformers(kind: str, overrides: dict, tmp_path: Path) -> None:
    folder = save_tiny(kind, tmp_path / kind, **overrides)
    model = load_model(folder, dtype=torch.float32)
    ids = torch.randint(0, 97, (21,), generator=torch.Generator().manual_seed(1))
    expected = reference_logits(folder, ids)

    one_shot = run(model, [[(0, ids, 0)]], {0: [5, 2, 9, 0, 7, 1]})[0]
    torch.testing.assert_close(one_shot, expected, atol=1e-4, rtol=1e-4)

    # Two chunks (the second reads the first through a scattered block table), then decode.
    chunked = run(
        model,
        [[(0, ids[:9], 0)], [(0, ids[9:20], 9)], [(0, ids[20:], 20)]],
        {0: [11, 3, 8, 0, 6, 2]},
    )
    torch.testing.assert_close(torch.cat(chunked), expected, atol=1e-4, rtol=1e-4)


def test_mixed_batch_equals_one_at_a_time(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "m")
    model = load_model(folder, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, 97, (n,), generator=gen) for n in (13, 6, 9))
    tables = {0: [0, 1, 2, 3], 1: [4, 5], 2: [6, 7, 8]}
    # Step 1: prefill a and b (minus their last token); step 2: decode a and b, prefill c.
    batched = run(
        model,
        [
            [(0, a[:-1], 0), (1, b[:-1], 0)],
            [(0, a[-1:], 12), (1, b[-1:], 5), (2, c, 0)],
        ],
        tables,
    )[1]
    for row, (ids, name) in enumerate([(a, 0), (b, 1)]):
        alone = run(model, [[(name, ids, 0)]], tables)[0][-1]
        torch.testing.assert_close(batched[row], alone, atol=1e-4, rtol=1e-4)
    c_alone = run(model, [[(2, c, 0)]], tables)[0]
    torch.testing.assert_close(batched[2:], c_alone, atol=1e-4, rtol=1e-4)


def test_bf16_default_is_close(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "m")
    model = load_model(folder)  # CPU default: bf16 compute
    assert model.dtype == torch.bfloat16
    ids = torch.arange(10)
    logits = run(model, [[(0, ids, 0)]], {0: [0, 1, 2]})[0]
    expected = reference_logits(folder, ids)
    assert logits.dtype == torch.float32
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


def test_registry_lists_supported_architectures(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(folder)


def test_missing_weight_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = save_tiny("llama", tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(MissingWeightError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(folder)
