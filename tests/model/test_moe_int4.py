"""int4 experts: the project's GPTQ scheme (real llm-compressor) on a tiny Qwen2-MoE (routed
experts plus the sigmoid-gated shared expert) and a tiny Mixtral, loaded onto the W4A8 CPU
kernel one expert at a time, routers and the shared-expert gate kept in full precision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_int4 import logits_of, needs_w4a8, reference_logits

from modelship.model import AttentionMetadata, allocate_kv_cache, load_model
from modelship.model.quant.int4 import W4A8Linear
from modelship.pipeline.optimize import recipe_for
from modelship.pipeline.optimize.schemes import create_scheme

from tiny_models import save_tiny_moe

# every width a multiple of the group size 64, so the W4A8 kernel takes every projection
WIDTHS = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
              shared_expert_intermediate_size=128)  # fmt: skip
SMALL = {"num_calibration_samples": 8, "max_seq_length": 64, "group_size": 64}


@pytest.fixture(scope="module")
def quantized_moe(tmp_path_factory) -> tuple[Path, Path]:
    base = save_tiny_moe("qwen2_moe", tmp_path_factory.mktemp("moe") / "base", **WIDTHS)
    out = tmp_path_factory.mktemp("moe-gptq")
    create_scheme("gptq").run(recipe_for("gptq", SMALL), base, out)
    return base, out


# llm-compressor saves Mixtral's experts under transformers 5's module names; Mixtral's own
# checkpoints (and transformers 5's save_pretrained) spell them w1/w3/w2
MIXTRAL_ORIGINAL_NAMES = {".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}


@pytest.fixture(scope="module")
def quantized_mixtral(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("mixtral") / "base"
    save_tiny_moe("mixtral", base, hidden_size=128, intermediate_size=128)
    out = tmp_path_factory.mktemp("mixtral-gptq")
    create_scheme("gptq").run(recipe_for("gptq", SMALL), base, out)
    return base, out


def with_original_expert_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renamed = {}
    for name, tensor in tensors.items():
        if ".experts." in name:
            for ours, original in MIXTRAL_ORIGINAL_NAMES.items():
                name = name.replace(ours, original)
        renamed[name] = tensor
    return renamed


def copy_folder(source: Path, target: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """`source`'s config and tokenizer files beside `tensors` as the weights."""
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (target / file.name).write_bytes(file.read_bytes())
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def dequantized_mixtral_logits(base: Path, folder: Path, ids: torch.Tensor, tmp: Path):
    """transformers' fp32 logits with the int4 checkpoint's weights dequantized by
    compressed-tensors. transformers 5 cannot load the int4 Mixtral itself (its stacked
    experts come up missing), so the weights go to a dense copy of the base model, under
    the original expert names its own checkpoints have."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    tensors = load_file(folder / "model.safetensors")
    dense = {}
    for name, tensor in tensors.items():
        module, _, kind = name.rpartition(".")
        if kind == "weight_packed":
            parts = {
                k.rpartition(".")[2]: v for k, v in tensors.items() if k.startswith(module + ".")
            }
            weight = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
            dense[f"{module}.weight"] = weight.float()
        elif not kind.startswith("weight_"):
            dense[name] = tensor.float()
    return reference_logits(copy_folder(base, tmp, with_original_expert_names(dense)), ids)


def test_routers_stay_full_precision_in_the_checkpoint(quantized_moe) -> None:
    _, folder = quantized_moe
    ignore = json.loads((folder / "config.json").read_text())["quantization_config"]["ignore"]
    assert {"model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"} <= set(ignore)


@needs_w4a8
def test_experts_run_on_the_w4a8_kernel_within_int4_tolerance(quantized_moe) -> None:
    _, folder = quantized_moe
    model = load_model(folder)  # CPU, bf16 compute, group size 64: the W4A8 kernel
    mlp = model.layers[0].mlp
    for expert in [*mlp.experts, mlp.shared_expert]:
        assert isinstance(expert.gate_up_proj, W4A8Linear)
        assert isinstance(expert.down_proj, W4A8Linear)
    ids = torch.arange(3, 40)
    expected = reference_logits(folder, ids)  # transformers, dequantized to fp32
    actual = logits_of(model, ids)
    assert (actual - expected).abs().max() < 0.05 * expected.abs().max()
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


@needs_w4a8
def test_mixtral_experts_load_from_llm_compressors_names(quantized_mixtral, tmp_path) -> None:
    base, folder = quantized_mixtral
    model = load_model(folder)  # CPU, bf16 compute: the W4A8 kernel
    for expert in model.layers[0].mlp.experts:
        assert isinstance(expert.gate_up_proj, W4A8Linear)
        assert isinstance(expert.down_proj, W4A8Linear)
    ids = torch.arange(3, 40)
    expected = dequantized_mixtral_logits(base, folder, ids, tmp_path)
    actual = logits_of(model, ids)
    assert (actual - expected).abs().max() < 0.05 * expected.abs().max()
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def cpu_logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    """`logits_of` on the CPU attention kernel: the fused decoder's steps where it is on."""
    caches = allocate_kv_cache(model.config, 8, 16, torch.float32, "cpu")
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[5, 1, 2, 3]], 16, "cpu", "cpu")
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), caches, meta))


@needs_w4a8
@pytest.mark.parametrize("fixture", ["quantized_moe", "quantized_mixtral"])
def test_fused_decoder_runs_int4_experts_within_int4_tolerance(
    fixture: str, request, tmp_path
) -> None:
    base, folder = request.getfixturevalue(fixture)
    ids = torch.arange(3, 40)
    model = load_model(folder)  # CPU, bf16 compute: W4A8 experts, all layers in the fused op
    assert model.fused_decoder is not None
    actual = cpu_logits_of(model, ids)
    if fixture == "quantized_mixtral":
        expected = dequantized_mixtral_logits(base, folder, ids, tmp_path)
    else:
        expected = reference_logits(folder, ids)  # transformers, dequantized to fp32
    assert (actual - expected).abs().max() < 0.05 * expected.abs().max()
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    # fp32 activations on both paths: they differ only where an fp32 norm's last bit moves
    # an activation across an int8 rounding boundary (`test_fused_decoder.ONE_INT8_STEP`)
    model = load_model(folder, dtype=torch.float32)
    fused = cpu_logits_of(model, ids)
    model.fused_decoder = None
    unfused = cpu_logits_of(model, ids)
    assert (fused - unfused).norm() < 0.02 * unfused.norm()
    assert (fused.argmax(-1) == unfused.argmax(-1)).float().mean() >= 0.9


def test_mixtral_int4_checkpoint_with_the_original_expert_names_loads_the_same(
    quantized_mixtral, tmp_path
) -> None:
    """The same int4 tensors renamed to Mixtral's `w1/w3/w2` give the same model."""
    _, folder = quantized_mixtral
    renamed = with_original_expert_names(load_file(folder / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight_packed" in renamed
    ids = torch.arange(3, 40)
    expected = logits_of(load_model(folder, dtype=torch.float32), ids)
    actual = logits_of(load_model(copy_folder(folder, tmp_path, renamed), dtype=torch.float32), ids)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def test_router_choices_equal_the_unquantized_models(quantized_moe) -> None:
    """Fed the same hidden states, every layer's router (read from the int4 checkpoint, in
    fp16 as the scheme saves it) picks the experts the fp32 original picks, token by token."""
    base, folder = quantized_moe
    original = load_model(base, dtype=torch.float32)
    quantized = load_model(folder, dtype=torch.float32)
    inputs: list[torch.Tensor] = []
    for layer in original.layers:
        layer.mlp.gate.register_forward_hook(lambda m, args, out: inputs.append(args[0]))
    logits_of(original, torch.arange(3, 60))
    assert len(inputs) == len(quantized.layers)
    for layer, (ours, theirs) in enumerate(zip(quantized.layers, original.layers, strict=True)):
        x = inputs[layer]
        assert torch.equal(ours.mlp.route(x), theirs.mlp.route(x)), f"layer {layer}"


def test_awq_smooths_an_olmoe_router_with_its_experts(tmp_path) -> None:
    """AWQ on OLMoE (no mappings of its own in llm-compressor) rescales the post-attention
    norm's output for the experts and the router alike: every layer routes as the fp32
    original does on the same hidden states. (Mixtral gets the same mappings.)"""
    base = save_tiny_moe("olmoe", tmp_path / "base", hidden_size=128, intermediate_size=128)
    out = tmp_path / "awq"
    create_scheme("awq").run(recipe_for("awq", {**SMALL, "options": {"n_grid": 4}}), base, out)
    original = load_model(base, dtype=torch.float32)
    quantized = load_model(out, dtype=torch.float32)
    inputs: list[torch.Tensor] = []
    for layer in original.layers:
        layer.post_attention_layernorm.register_forward_hook(
            lambda m, args, out: inputs.append(args[0])
        )
    logits_of(original, torch.arange(3, 60))
    for layer, (ours, theirs) in enumerate(zip(quantized.layers, original.layers, strict=True)):
        x = inputs[layer]  # the residual stream the norm reads, identical for both
        normed = ours.post_attention_layernorm(x)
        assert torch.equal(
            ours.mlp.route(normed), theirs.mlp.route(theirs.post_attention_layernorm(x))
        ), layer
