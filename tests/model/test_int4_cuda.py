"""int4 on CUDA (torch's tinygemm kernel): operands checked on CPU, the kernel on a GPU.

Also the W4A16 checkpoint writer of benchmarks/gpu_models.py: what it writes must be what
llm-compressor writes, since the GPU benchmark's int4 numbers rest on it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from modelship.model import load_model
from modelship.model.config import ModelConfig
from modelship.model.loader import resolve_dtype
from modelship.model.quant import create_quantization
from modelship.model.quant.base import DenseLinear
from modelship.model.quant.compressed_tensors import pack_linear
from modelship.model.quant.int4 import (
    CudaInt4Linear,
    cuda_inner_k_tiles,
    cuda_kernel_available,
    cuda_kernel_supports,
    dequantize,
    pack_int4,
    prepare_tinygemm_operands,
    unpack_int4,
)

needs_cuda_kernel = pytest.mark.skipif(
    not cuda_kernel_available("cuda"), reason="needs a CUDA GPU with bf16 tensor cores (sm80+)"
)


def random_int4(out_features: int, in_features: int, group_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    groups = in_features // group_size
    scale = torch.rand(out_features, groups, generator=gen) * 0.1 + 0.01
    zero_point = torch.randint(-8, 8, (out_features, groups), generator=gen, dtype=torch.int32)
    return u, scale, zero_point


def ref_dequantize_tinygemm(
    packed_pairs: torch.Tensor,  # [out, in / 2] uint8, even column in the high nibble
    scales_and_zeros: torch.Tensor,  # [in / group_size, out, 2] bf16
    group_size: int,
) -> torch.Tensor:  # [out, in] fp32
    """The weight tinygemm computes with: (u - 8) * scale + zero, from its own inputs."""
    high, low = (packed_pairs >> 4).int(), (packed_pairs & 0xF).int()
    u = torch.stack([high, low], dim=-1).view(packed_pairs.shape[0], -1)  # columns interleaved
    scale = scales_and_zeros[..., 0].float().t().repeat_interleave(group_size, dim=1)
    zero = scales_and_zeros[..., 1].float().t().repeat_interleave(group_size, dim=1)
    return (u - 8).float() * scale + zero


def test_pack_int4_inverts_unpack_and_matches_compressed_tensors() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    u, _, _ = random_int4(24, 80, 16)  # 80 columns: ten full words
    packed = pack_int4(u)
    assert packed.dtype == torch.int32 and packed.shape == (24, 10)
    assert torch.equal(unpack_int4(packed, 80), u)
    assert torch.equal(packed, pack_to_int32((u - 8).to(torch.int8), 4))
    ragged = pack_int4(u[:, :13])  # a partial last word is padded with zeros
    assert torch.equal(unpack_int4(ragged, 13), u[:, :13])


def test_tinygemm_operands_dequantize_like_dequantize() -> None:
    group_size = 64
    u, scale, zero_point = random_int4(48, 256, group_size)
    pairs, scales_and_zeros = prepare_tinygemm_operands(u, scale, zero_point)
    assert pairs.dtype == torch.uint8 and pairs.shape == (48, 128)
    assert scales_and_zeros.dtype == torch.bfloat16 and scales_and_zeros.shape == (4, 48, 2)
    assert pairs[3, 5].item() == (u[3, 10].item() << 4) | u[3, 11].item()  # even column high
    # The nibbles round-trip exactly; scale and zero are rounded to bf16 once each.
    expected = dequantize(u, scale.bfloat16().float(), zero_point, group_size)
    actual = ref_dequantize_tinygemm(pairs, scales_and_zeros, group_size)
    zero_rounding = (zero_point.abs() * scale).max() * 2**-8  # bf16: 8 significant bits
    assert (actual - expected).abs().max() <= zero_rounding
    symmetric = prepare_tinygemm_operands(u, scale, torch.zeros_like(zero_point))
    torch.testing.assert_close(
        ref_dequantize_tinygemm(*symmetric, group_size),
        dequantize(u, scale.bfloat16().float(), torch.zeros_like(zero_point), group_size),
        atol=0,
        rtol=0,
    )


@pytest.mark.parametrize(
    ("shape", "group_size", "supported", "inner_k_tiles"),
    [
        ((2048, 2048), 128, True, 8),
        ((576, 576), 64, True, 4),  # SmolLM2: 576 = 36 x 16
        ((1536, 576), 64, True, 4),
        ((96, 96), 32, True, 2),
        ((100, 256), 128, False, 8),  # output rows not a multiple of 8
        ((256, 256), 16, False, 8),  # group size the kernel lacks
        ((256, 192), 128, False, 4),  # groups do not divide the input
        ((256, 64), 64, True, 4),
    ],
)
def test_cuda_kernel_shapes(shape, group_size, supported, inner_k_tiles) -> None:
    out_features, in_features = shape
    assert cuda_kernel_supports(out_features, in_features, group_size) is supported
    assert cuda_inner_k_tiles(in_features) == inner_k_tiles


def test_cuda_kernel_needs_a_gpu() -> None:
    assert not cuda_kernel_available("cpu")


def test_w4a16_computes_in_bf16_on_cuda(tiny_llama_dir: Path, tmp_path: Path, monkeypatch) -> None:
    int4_dir = write_checkpoint(tiny_llama_dir, tmp_path / "w4a16", 32, symmetric=True)
    config = ModelConfig.from_dir(int4_dir)
    config_fp16 = ModelConfig.from_dir(tiny_llama_dir)
    cuda = torch.device("cuda")
    monkeypatch.setattr("modelship.model.loader.cuda_kernel_available", lambda device: True)
    assert resolve_dtype(config, cuda, None) == torch.bfloat16
    assert resolve_dtype(config, cuda, "float16") == torch.float16  # asked for: honoured
    assert resolve_dtype(config_fp16, cuda, None) == torch.float16  # dense fp32 checkpoint
    monkeypatch.setattr("modelship.model.loader.cuda_kernel_available", lambda device: False)
    assert resolve_dtype(config, cuda, None) == torch.float16  # pre-sm80: dequantized, fp16


# The benchmark's checkpoint writer ---------------------------------------------------------
def gpu_models():
    """benchmarks/gpu_models.py (benchmarks are scripts, not a package)."""
    path = Path(__file__).parents[2] / "benchmarks" / "gpu_models.py"
    spec = importlib.util.spec_from_file_location("gpu_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_checkpoint(dense_dir: Path, out_dir: Path, group_size: int, symmetric: bool) -> Path:
    return gpu_models().write_w4a16_checkpoint(dense_dir, out_dir, group_size, symmetric)


@pytest.mark.parametrize("symmetric", [True, False])
def test_benchmark_checkpoint_loads_as_written(
    tiny_llama_dir: Path, tmp_path: Path, symmetric: bool
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    bench = gpu_models()
    int4_dir = bench.write_w4a16_checkpoint(tiny_llama_dir, tmp_path / "w4a16", 32, symmetric)
    quant = json.loads((int4_dir / "config.json").read_text())["quantization_config"]
    create_quantization(quant)  # parses
    dense = load_file(tiny_llama_dir / "model.safetensors")
    stored = load_file(int4_dir / "model.safetensors")
    assert any(k.endswith("weight_zero_point") for k in stored) == (not symmetric)
    # Our loader's dense fp32 weights are the writer's quantized weights, projection by
    # projection (q/k/v fused in that order).
    model = load_model(int4_dir, dtype=torch.float32)
    qkv = model.layers[0].qkv_proj
    assert isinstance(qkv, DenseLinear)
    expected = []
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = dense[f"model.layers.0.self_attn.{name}.weight"]
        u, scale, zero_point = bench.quantize_rtn(weight, 32, symmetric)
        expected.append(dequantize(u, scale, zero_point, 32))
        assert (expected[-1] - weight.float()).abs().max() <= scale.float().max() * 0.51
    torch.testing.assert_close(qkv.weight, torch.cat(expected), atol=0, rtol=0)
    # transformers with compressed-tensors (llm-compressor's reader) decompresses the same
    # weights (on the model's first forward).
    reference = AutoModelForCausalLM.from_pretrained(int4_dir, dtype=torch.float32)
    with torch.no_grad():
        reference(torch.tensor([[3, 4, 5]]))
    ref_q = reference.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(ref_q.float(), expected[0], atol=0, rtol=0)


def test_pack_linear_round_trips_through_the_loader() -> None:
    u, scale, zero_point = random_int4(40, 128, 32, seed=3)
    tensors = {f"p.{k}": v for k, v in pack_linear(u, scale, zero_point).items()}
    method = create_quantization(
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "g": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "strategy": "group",
                        "group_size": 32,
                        "symmetric": False,
                    },
                }
            },
        }
    )
    linear = method.load_linear(tensors.__getitem__, ["p"], False, torch.float32, "cpu")
    torch.testing.assert_close(linear.weight, dequantize(u, scale, zero_point, 32))


# On a GPU ----------------------------------------------------------------------------------
@needs_cuda_kernel
@pytest.mark.parametrize(
    ("out_features", "in_features", "group_size"),
    [(256, 512, 128), (576, 576, 64), (1536, 576, 64), (96, 96, 32), (2048, 8192, 128)],
)
@pytest.mark.parametrize("num_rows", [1, 7, 64])
def test_cuda_int4_linear_matches_dequantized_matmul(
    out_features: int, in_features: int, group_size: int, num_rows: int
) -> None:
    u, scale, zero_point = random_int4(out_features, in_features, group_size, seed=num_rows)
    bias = torch.randn(out_features).bfloat16()
    linear = CudaInt4Linear.from_unpacked(u, scale, zero_point, group_size, bias, "cuda")
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(1))
    xb = x.bfloat16().cuda()
    actual = linear(xb)
    assert actual.dtype == torch.bfloat16 and actual.shape == (num_rows, out_features)
    pairs, scales_and_zeros = prepare_tinygemm_operands(u, scale, zero_point)
    weight = ref_dequantize_tinygemm(pairs, scales_and_zeros, group_size).cuda()
    expected = xb.float() @ weight.t() + bias.float().cuda()
    # bf16 output of a fp32-accumulated dot product over `in_features` terms
    tolerance = 1e-2 * expected.abs().max().item()
    assert (actual.float() - expected).abs().max().item() <= tolerance
    assert linear(xb[:0]).shape == (0, out_features)
    assert linear(x.cuda()).dtype == torch.float32  # other activations: cast in and out


@needs_cuda_kernel
def test_cuda_w4a16_model_matches_dequantized(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from modelship.model import AttentionMetadata, allocate_kv_cache

    int4_dir = write_checkpoint(tiny_llama_dir, tmp_path / "w4a16", 32, symmetric=False)
    model = load_model(int4_dir, device="cuda")  # bf16: the W4A16 default on CUDA
    assert model.dtype == torch.bfloat16
    assert isinstance(model.layers[0].qkv_proj, CudaInt4Linear)
    assert isinstance(model.layers[0].mlp.down_proj, CudaInt4Linear)
    dense = load_model(int4_dir, device="cuda", dtype=torch.float32)
    assert isinstance(dense.layers[0].qkv_proj, DenseLinear)
    ids = torch.arange(3, 40, device="cuda")

    def logits(m, dtype):
        caches = allocate_kv_cache(m.config, 8, 16, dtype, "cuda")
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [[5, 1, 2, 3]], 16, "cuda")
        with torch.no_grad():
            positions = torch.arange(len(ids), device="cuda")
            return m.compute_logits(m(ids, positions, caches, meta)).float()

    actual, expected = logits(model, torch.bfloat16), logits(dense, torch.float32)
    assert (actual - expected).abs().max() < 0.05 * expected.abs().max()
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
