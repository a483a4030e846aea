"""int4 (compressed-tensors W4A16) checkpoints written by llm-compressor, on our load paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelship.model import AttentionMetadata, allocate_kv_cache, cpu_kernels, load_model
from modelship.model.quant import UnsupportedQuantizationError, create_quantization
from modelship.model.quant.base import DenseLinear
from modelship.model.quant.compressed_tensors import _unpack_zero_point
from modelship.model.quant.int4 import (
    Int4Linear,
    W4A8Linear,
    create_int4_linear,
    dequantize,
    unpack_int4,
)
from modelship.model.quant.int8 import W8A8Linear
from modelship.pipeline.optimize import recipe_for
from modelship.pipeline.optimize.schemes import create_scheme

SMALL = {"num_calibration_samples": 8, "max_seq_length": 64, "group_size": 32}


@pytest.fixture(scope="module", params=["gptq", "awq"])
def quantized(request, tiny_llama_dir: Path, tmp_path_factory) -> tuple[str, Path]:
    """The project's own optimize schemes (llm-compressor GPTQ / AWQ, fp16 scales)."""
    variant = request.param
    out = tmp_path_factory.mktemp(variant)
    create_scheme(variant).run(recipe_for(variant, SMALL), tiny_llama_dir, out)
    return variant, out


@pytest.fixture(scope="module", params=["gptq", "awq"])
def quantized_g64(request, tiny_llama_dir: Path, tmp_path_factory) -> tuple[str, Path]:
    """The same schemes at group size 64, the demo model's: the W4A8 kernel takes it."""
    variant = request.param
    out = tmp_path_factory.mktemp(f"{variant}-g64")
    create_scheme(variant).run(recipe_for(variant, SMALL | {"group_size": 64}), tiny_llama_dir, out)
    return variant, out


needs_w4a8 = pytest.mark.skipif(
    not cpu_kernels.load(), reason="modelship's W4A8 kernel needs an AVX2 CPU and a compiler"
)


def ref_w4a8(x: torch.Tensor, u, scale, zero_point, group_size: int) -> torch.Tensor:
    """Plain-torch W4A8: activations rounded to int8 per row and weight group (symmetric,
    amax / 127), integer dot products per group, then scaled; fp32 [n, out]."""
    n, k = x.shape
    xg = x.float().view(n, k // group_size, group_size)
    d = xg.abs().amax(-1, keepdim=True) / 127  # [n, groups, 1]
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))  # the kernel multiplies by 1 / d
    q = (xg * inv).round()  # [n, groups, G], ties to even as the kernel rounds
    ug = u.float().view(u.shape[0], k // group_size, group_size)  # [out, groups, G]
    dots = torch.einsum("ngk,ogk->nog", q.double(), ug.double()).float()  # exact integers
    sums = q.sum(-1)  # [n, groups]
    mins = -(8 + zero_point.float()) * scale.float()  # [out, groups]
    s16, m16 = scale.half().float(), mins.half().float()  # stored as fp16
    return (dots * s16 * d.squeeze(-1)[:, None, :]).sum(-1) + (sums * d.squeeze(-1)) @ m16.t()


@pytest.fixture(scope="module", params=["rtn-group16", "gptq-actorder"])
def quantized_direct(request, tiny_llama_dir: Path, tmp_path_factory) -> tuple[str, Path]:
    """llm-compressor called directly: asymmetric round-to-nearest with group size 16 (the
    kernel takes 32 and up), and GPTQ with `actorder: weight` (columns reordered while
    quantizing, stored in the original order)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    weights = {"num_bits": 4, "type": "int", "strategy": "group"}
    if request.param == "rtn-group16":
        weights |= {"symmetric": False, "group_size": 16}
        modifier = QuantizationModifier(
            targets="Linear",
            ignore=["lm_head"],
            config_groups={"g": {"targets": ["Linear"], "weights": weights}},
        )
        oneshot(model=model, recipe=[modifier])
    else:
        weights |= {"symmetric": True, "group_size": 32, "actorder": "weight"}
        modifier = GPTQModifier(
            targets="Linear",
            ignore=["lm_head"],
            config_groups={"g": {"targets": ["Linear"], "weights": weights}},
        )
        gen = torch.Generator().manual_seed(0)
        ids = [torch.randint(0, 300, (32,), generator=gen).tolist() for _ in range(4)]
        dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 32] * 4})
        oneshot(model=model, dataset=dataset, recipe=[modifier], num_calibration_samples=4)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out, save_compressed=True)
    return request.param, out


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    caches = allocate_kv_cache(model.config, 8, 16, torch.float32, "cpu")
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[5, 1, 2, 3]], 16, "cpu")
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), caches, meta))


def reference_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers + compressed-tensors decompress the checkpoint to dense fp32 weights."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return reference(ids.unsqueeze(0)).logits[0]


def test_int4_kernel_matches_dequantized_reference(quantized) -> None:
    _variant, folder = quantized
    model = load_model(folder)  # CPU, group size 32: bf16 activations on torch's int4 kernel
    layer = model.layers[0]
    for linear in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, Int4Linear)
    assert isinstance(model.lm_head, DenseLinear)  # `ignore: [lm_head]`
    ids = torch.arange(3, 40)
    expected = reference_logits(folder, ids)
    actual = logits_of(model, ids)
    # bf16 activations vs fp32 dense: close, and the same argmax nearly everywhere
    assert (actual - expected).abs().max() < 0.05 * expected.abs().max()
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_fp32_compute_dequantizes_exactly(quantized) -> None:
    _variant, folder = quantized
    model = load_model(folder, dtype=torch.float32)  # the kernel is bf16-only: dense fp32
    assert isinstance(model.layers[0].qkv_proj, DenseLinear)
    ids = torch.arange(3, 40)
    torch.testing.assert_close(
        logits_of(model, ids), reference_logits(folder, ids), atol=2e-4, rtol=1e-3
    )


def test_asymmetric_zero_points_are_used(quantized) -> None:
    from safetensors import safe_open

    variant, folder = quantized
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert any(n.endswith("weight_zero_point") for n in names) == (variant == "awq")


def test_direct_llmcompressor_layouts(quantized_direct: tuple[str, Path]) -> None:
    variant, folder = quantized_direct
    model = load_model(folder)
    # group size 16 is not a kernel group size: dequantized once at load time
    expected_type = DenseLinear if variant == "rtn-group16" else Int4Linear
    assert isinstance(model.layers[0].qkv_proj, expected_type)
    ids = torch.arange(3, 40)
    expected = reference_logits(folder, ids)
    actual = logits_of(model, ids)
    assert (actual - expected).abs().max() < 0.05 * expected.abs().max()
    fp32 = logits_of(load_model(folder, dtype=torch.float32), ids)
    torch.testing.assert_close(fp32, expected, atol=2e-4, rtol=1e-3)


def test_unpacking_matches_compressed_tensors() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(0)
    values = torch.randint(-8, 8, (24, 72), generator=gen, dtype=torch.int8)  # q in [-8, 7]
    packed = pack_to_int32(values, 4)  # along the input dim, as weights are stored
    assert torch.equal(unpack_int4(packed, 72) - 8, values.int())
    zero_points = torch.randint(-8, 8, (20, 3), generator=gen, dtype=torch.int8)
    packed_zp = pack_to_int32(zero_points, 4, packed_dim=0)  # along the output dim
    assert packed_zp.shape == (3, 3)
    assert torch.equal(_unpack_zero_point(packed_zp, 20), zero_points.int())


def test_unpack_int4_bit_order() -> None:
    values = list(range(10))
    packed = torch.zeros(1, 2, dtype=torch.int32)
    for i, v in enumerate(values):
        packed[0, i // 8] |= v << (4 * (i % 8))
    assert unpack_int4(packed, 10).tolist() == [values]


@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_linear_matches_dequantized_matmul(with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    out_features, in_features, group_size = 48, 128, 32
    u = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    scale = torch.rand(out_features, in_features // group_size, generator=gen) * 0.1 + 0.01
    zero_point = torch.randint(-8, 8, scale.shape, generator=gen, dtype=torch.int32)
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    linear = Int4Linear.from_unpacked(u, scale, zero_point, group_size, bias)
    x = torch.randn(5, in_features, generator=gen).bfloat16()
    weight = dequantize(u, scale, zero_point, group_size)  # [out, in] fp32
    expected = x.float() @ weight.t() + (bias.float() if bias is not None else 0)
    actual = linear(x)
    assert actual.dtype == torch.bfloat16 and actual.shape == (5, out_features)
    torch.testing.assert_close(actual.float(), expected, atol=0.05, rtol=0.02)


@needs_w4a8
@pytest.mark.parametrize("group_size", [64, 128, 256])
@pytest.mark.parametrize("num_rows", [1, 3, 4, 9])
def test_w4a8_kernel_matches_reference(group_size: int, num_rows: int) -> None:
    gen = torch.Generator().manual_seed(group_size + num_rows)
    out_features, in_features = 40, 512
    u = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    scale = torch.rand(out_features, in_features // group_size, generator=gen) * 0.1 + 0.01
    zero_point = torch.randint(-8, 8, scale.shape, generator=gen, dtype=torch.int32)
    linear = W4A8Linear.from_unpacked(u, scale, zero_point, group_size, None)
    x = torch.randn(num_rows, in_features, generator=gen)
    x[0, :group_size] = 0  # an all-zero group quantizes to scale 0, not NaN
    expected = ref_w4a8(x, u, scale, zero_point, group_size)
    torch.testing.assert_close(linear(x), expected, atol=1e-3, rtol=1e-4)  # fp32 in and out
    # bf16 activations: the same arithmetic on the bf16-rounded input, rounded once at the end
    xb = x.bfloat16()
    expected_b = ref_w4a8(xb.float(), u, scale, zero_point, group_size)
    torch.testing.assert_close(linear(xb).float(), expected_b, atol=2e-2, rtol=1e-2)
    # and within int8-activation error of the exact dequantized product
    exact = x @ dequantize(u, scale, zero_point, group_size).t()
    assert (linear(x) - exact).abs().max() < 0.02 * exact.abs().max()


@needs_w4a8
@pytest.mark.parametrize("in_features", [576, 1536])  # the demo model's hidden and MLP widths
def test_w4a8_rows_do_not_depend_on_the_batch(in_features: int) -> None:
    # 1536 (24 groups) caught rows rounding differently by tile shape when the compiler
    # contracted scalar multiply-adds in some template instances only (-ffp-contract=off)
    gen = torch.Generator().manual_seed(1)
    groups = in_features // 64
    u = torch.randint(0, 16, (96, in_features), generator=gen, dtype=torch.int32)
    scale = torch.rand(96, groups, generator=gen) * 0.05
    zero_point = torch.randint(-8, 8, (96, groups), generator=gen, dtype=torch.int32)
    linear = W4A8Linear.from_unpacked(u, scale, zero_point, 64, None)
    x = torch.randn(11, in_features, generator=gen).bfloat16()
    whole = linear(x)
    for i in range(11):  # alone, and at every position of smaller batches
        assert torch.equal(linear(x[i : i + 1])[0], whole[i])
        assert torch.equal(linear(x[max(0, i - 4) : i + 1])[-1], whole[i])


@needs_w4a8
def test_w4a8_pads_output_rows_to_whole_blocks() -> None:
    # the row-interleaved layout packs 8 output rows per block: 37 rows take 5 blocks, the
    # padding rows are dropped, and the real rows stay exact and batch-invariant
    gen = torch.Generator().manual_seed(3)
    u = torch.randint(0, 16, (37, 576), generator=gen, dtype=torch.int32)
    scale = torch.rand(37, 9, generator=gen) * 0.05 + 0.01
    zero_point = torch.randint(-8, 8, (37, 9), generator=gen, dtype=torch.int32)
    linear = W4A8Linear.from_unpacked(u, scale, zero_point, 64, None)
    assert linear.qweight.shape == (5, 4 * 576) and linear.scales.shape == (5, 9, 8)
    x = torch.randn(6, 576, generator=gen)
    whole = linear(x)
    assert whole.shape == (6, 37)
    torch.testing.assert_close(whole, ref_w4a8(x, u, scale, zero_point, 64), atol=1e-3, rtol=1e-4)
    for i in range(6):
        assert torch.equal(linear(x[i : i + 1])[0], whole[i])


@needs_w4a8
@pytest.mark.skipif(
    not cpu_kernels.load() or cpu_kernels.q4_kernel_isa() != "vnni",
    reason="the VNNI path needs a CPU with AVX512-VNNI",
)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 16, 37, 128])
def test_w4a8_vnni_and_avx2_paths_give_the_same_bits(num_rows: int) -> None:
    # the two instruction sets sum the same integers per lane, then run one float epilogue:
    # a replica's output must not depend on which CPU of a fleet serves it. The VNNI path
    # tiles rows by 4 in passes sized to L1 (40 rows at 576 columns, 16 at 1536): 5 and 37
    # rows end in a smaller tile, 128 in several passes; 100 outputs end in a partial block
    gen = torch.Generator().manual_seed(num_rows)
    for out_features, in_features, group_size in ((96, 576, 64), (100, 1536, 64), (96, 512, 256)):
        groups = in_features // group_size
        u = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
        scale = torch.rand(out_features, groups, generator=gen) * 0.05
        zero_point = torch.randint(-8, 8, scale.shape, generator=gen, dtype=torch.int32)
        packed = cpu_kernels.pack_q4(u, scale, zero_point)
        x = torch.randn(num_rows, in_features, generator=gen)
        for xd in (x, x.bfloat16()):
            avx2 = cpu_kernels.q4_linear(xd, *packed, group_size, "avx2")
            vnni = cpu_kernels.q4_linear(xd, *packed, group_size, "vnni")
            assert torch.equal(avx2, vnni)


def test_int4_kernel_choice() -> None:
    gen = torch.Generator().manual_seed(2)
    u = torch.randint(0, 16, (32, 128), generator=gen, dtype=torch.int32)
    scale, zero_point = torch.rand(32, 2, generator=gen), torch.zeros(32, 2, dtype=torch.int32)
    assert isinstance(create_int4_linear(u, scale, zero_point, 64, None, "torch"), Int4Linear)
    expected = W4A8Linear if cpu_kernels.load() else Int4Linear
    assert isinstance(create_int4_linear(u, scale, zero_point, 64, None, "auto"), expected)
    u32 = torch.randint(0, 16, (32, 96), generator=gen, dtype=torch.int32)
    s32, z32 = torch.rand(32, 3, generator=gen), torch.zeros(32, 3, dtype=torch.int32)
    # group size 32 is not W4A8's: auto falls back, an explicit request says why it cannot
    assert isinstance(create_int4_linear(u32, s32, z32, 32, None, "auto"), Int4Linear)
    with pytest.raises(ValueError, match="group_size=32"):
        create_int4_linear(u32, s32, z32, 32, None, "w4a8")
    with pytest.raises(ValueError, match="supported: auto, w4a8, torch"):
        create_int4_linear(u, scale, zero_point, 64, None, "fast")


@needs_w4a8
def test_w4a8_on_real_schemes_matches_dequantized_reference(quantized_g64) -> None:
    _variant, folder = quantized_g64
    model = load_model(folder)  # auto: group size 64 on an AVX2 CPU -> W4A8
    layer = model.layers[0]
    for linear in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, W4A8Linear)
    ids = torch.arange(3, 40)
    expected = reference_logits(folder, ids)
    actual = logits_of(model, ids)
    assert (actual - expected).abs().max() < 0.05 * expected.abs().max()
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    torch_kernel = logits_of(load_model(folder, int4_kernel="torch"), ids)
    assert isinstance(load_model(folder, int4_kernel="torch").layers[0].qkv_proj, Int4Linear)
    # all-W4A8 layers run fused on CPU-kernel steps by default; torch's kernel cannot
    assert model.fused_decoder is not None
    assert load_model(folder, int4_kernel="torch").fused_decoder is None
    assert load_model(folder, fused_decoder=False).fused_decoder is None
    assert (actual - torch_kernel).abs().max() < 0.05 * expected.abs().max()


def _config(**weights) -> dict:
    args = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32} | weights
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}},
        "ignore": ["lm_head", "re:.*mlp\\.down_proj$"],
    }


def test_targets_and_ignore_patterns() -> None:
    method = create_quantization(_config())
    assert method.scheme_for("model.layers.3.self_attn.q_proj") is not None
    assert method.scheme_for("model.layers.3.mlp.down_proj") is None
    assert method.scheme_for("lm_head") is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"quant_method": "bitsandbytes"},
            r"'bitsandbytes' is not supported; supported: compressed",
        ),
        (_config(num_bits=8), r"only 4-bit int group-wise"),
        (_config(strategy="channel"), r"only 4-bit int group-wise"),
        (_config(actorder="group"), r"actorder 'group'"),
        ({**_config(), "format": "float-quantized"}, r"need pack-quantized"),
    ],
)
def test_unsupported_quantization_is_refused(config: dict, message: str) -> None:
    with pytest.raises(UnsupportedQuantizationError, match=message):
        create_quantization(config)


@needs_w4a8
def test_int8_head_matches_dense_logits(quantized_g64) -> None:
    _variant, folder = quantized_g64
    dense = load_model(folder, lm_head="dense")
    model = load_model(folder)  # auto: a quantized checkpoint on CPU gets the int8 head
    assert isinstance(model.quantized_head, W8A8Linear) and dense.quantized_head is None
    hidden = torch.randn(7, dense.config.hidden_size).bfloat16()
    expected = dense.compute_logits(hidden)
    actual = model.compute_logits(hidden)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert (actual - expected).abs().max() < 0.02 * expected.abs().max()
    assert torch.equal(model.compute_logits(hidden[3:4])[0], actual[3])  # batch-invariant


def test_int8_head_option_errors(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="supported: auto, int8, int4, dense"):
        load_model(tiny_llama_dir, lm_head="int2")
    assert load_model(tiny_llama_dir).quantized_head is None  # auto: dense checkpoints keep theirs


def test_a_killed_builds_lock_is_removed_and_a_live_builder_waited_for(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "lock").touch()  # torch's build lock, left by a build killed mid-way
    with cpu_kernels._one_builder(tmp_path):
        assert not (tmp_path / "lock").exists()
    # A live builder holds the flock: the next one enters only after it is done.
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import fcntl, sys, time, pathlib\n"
            f"d = pathlib.Path({str(tmp_path)!r})\n"
            "f = open(d / 'modelship.flock', 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
            "(d / 'lock').touch(); print('held', flush=True); time.sleep(1)\n"
            "(d / 'lock').unlink(); (d / 'built').touch()\n"
        )],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    with cpu_kernels._one_builder(tmp_path):
        assert (tmp_path / "built").exists()  # it finished its build before we entered
    assert holder.wait(timeout=30) == 0
