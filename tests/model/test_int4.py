"""int4 (compressed-tensors W4A16) checkpoints written by llm-compressor, run on our kernel path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelship.model import AttentionMetadata, allocate_kv_cache, load_model
from modelship.model.quant.compressed_tensors import Int4Linear, unpack_int4
from modelship.pipeline.optimize import recipe_for
from modelship.pipeline.optimize.schemes import create_scheme

SMALL = {"num_calibration_samples": 8, "max_seq_length": 64, "group_size": 32}


@pytest.fixture(scope="module", params=["gptq", "awq"])
def quantized(request, tiny_llama_dir: Path, tmp_path_factory) -> tuple[str, Path]:
    variant = request.param
    out = tmp_path_factory.mktemp(variant)
    recipe = recipe_for(variant, SMALL)
    create_scheme(variant).run(recipe, tiny_llama_dir, out)
    return variant, out


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    caches = allocate_kv_cache(model.config, 8, 16, torch.float32, "cpu")
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[0, 1, 2, 3]], 16, "cpu")
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), caches, meta))


def test_int4_kernel_matches_dequantized_reference(quantized) -> None:
    from transformers import AutoModelForCausalLM

    _variant, folder = quantized
    model = load_model(folder)  # CPU: bf16 activations on the int4 kernel
    layer = model.layers[0]
    assert isinstance(layer.qkv_proj, Int4Linear) and isinstance(layer.mlp.down_proj, Int4Linear)

    # transformers decompresses the same checkpoint to dense weights: the reference.
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.arange(3, 40)
    with torch.no_grad():
        expected = reference(ids.unsqueeze(0)).logits[0]
    actual = logits_of(model, ids)
    # bf16 activations vs fp32 dense: close, and the same argmax nearly everywhere
    assert (actual - expected).abs().max() < 0.1 * expected.abs().max()
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_asymmetric_zero_points_are_used(quantized) -> None:
    from safetensors import safe_open

    variant, folder = quantized
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = list(f.keys())
    has_zero_points = any(n.endswith("weight_zero_point") for n in names)
    assert has_zero_points == (variant == "awq")


def test_unpack_int4_bit_order() -> None:
    values = torch.arange(16, dtype=torch.int32).repeat(2)[:10].unsqueeze(0)  # 0..9
    packed = torch.zeros(1, 2, dtype=torch.int32)
    for i, v in enumerate(values[0].tolist()):
        packed[0, i // 8] |= v << (4 * (i % 8))
    assert torch.equal(unpack_int4(packed, 10), values)
