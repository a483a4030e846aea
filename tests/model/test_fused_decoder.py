"""The fused decoder op (`csrc/decoder_cpu.cpp`) against the unfused Python path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import demo_shaped
from demo_shaped import MIXED_STEPS, request_a_alone_and_chunked, run
from modelship.model import cpu_kernels, load_model
from modelship.model.llama import LlamaForCausalLM
from modelship.model.quant.int4 import W4A8Linear

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="needs AVX2 and a compiler")


def random_int4(
    out_features: int, in_features: int, gen: torch.Generator, bias: bool, dtype: torch.dtype
) -> nn.Module:
    """Random int4 weights at group size 64, of about unit gain."""
    groups = in_features // 64
    u = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    # std(u - 8) ~ 4.6
    scale = (torch.rand(out_features, groups, generator=gen) + 0.5) / (4.6 * in_features**0.5)
    zero_point = torch.randint(-2, 3, (out_features, groups), generator=gen, dtype=torch.int32)
    b = 0.1 * torch.randn(out_features, generator=gen).to(dtype) if bias else None
    return W4A8Linear.from_unpacked(u, scale, zero_point, 64, b)


def demo_shaped_model(
    num_layers: int = 2, qkv_bias: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0
) -> LlamaForCausalLM:
    """The demo model's shapes with random int4 projections and the int8 output head."""
    model = demo_shaped.demo_shaped_model(random_int4, num_layers, qkv_bias, dtype, seed)
    model.use_int8_head()
    return model


def row_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Relative error of each row [num_tokens]."""
    return (actual.float() - expected).norm(dim=-1) / expected.norm(dim=-1)


# Both paths quantize each projection's input to int8 per group of 64. Their fp32 norms
# differ in the last bit (summation order), which now and then moves a value across an
# int8 rounding boundary: that row then differs by one int8 step (~1e-3 relative), and the
# difference spreads to later rows and layers through attention and the next quantization.
ONE_INT8_STEP = 1e-2


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_one_fused_layer_matches_the_unfused_path(qkv_bias: bool) -> None:
    model = demo_shaped_model(num_layers=1, qkv_bias=qkv_bias)  # fp32 activations on both
    expected, expected_caches = run(model, MIXED_STEPS, fused=False)
    actual, actual_caches = run(model, MIXED_STEPS, fused=True)
    errors = []
    for e, a in zip(expected, actual, strict=True):
        assert a.dtype == torch.float32 and a.shape == e.shape
        errors.append(row_errors(a, e))
    errors = torch.cat(errors)
    assert errors.max() < ONE_INT8_STEP
    assert (errors < 1e-5).float().mean() >= 0.8  # rows where no int8 rounding flipped
    # q/k/v read the same norm of the same embeddings: the caches agree to fp32 rounding
    torch.testing.assert_close(actual_caches[0].kv, expected_caches[0].kv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_fused_layers_match_the_unfused_path_within_int8_noise(qkv_bias: bool) -> None:
    model = demo_shaped_model(num_layers=3, qkv_bias=qkv_bias)
    expected, _ = run(model, MIXED_STEPS, fused=False)
    actual, _ = run(model, MIXED_STEPS, fused=True)
    for e, a in zip(expected, actual, strict=True):  # a few steps' worth, spread out
        assert row_errors(a, e).max() < 3 * ONE_INT8_STEP
        assert (a - e).norm() < ONE_INT8_STEP * e.norm()


def test_fused_bf16_model_is_as_close_to_fp32_as_the_unfused_path() -> None:
    # the fused op keeps the residual stream in fp32 and rounds only its result to bf16
    reference, _ = run(demo_shaped_model(num_layers=2), MIXED_STEPS, fused=False)
    model = demo_shaped_model(num_layers=2, dtype=torch.bfloat16)
    fused, _ = run(model, MIXED_STEPS, fused=True)
    unfused, _ = run(model, MIXED_STEPS, fused=False)
    for r, f, u in zip(reference, fused, unfused, strict=True):
        assert f.dtype == torch.bfloat16
        assert (f.float() - r).norm() < 0.04 * r.norm()
        assert (u.float() - r).norm() < 0.04 * r.norm()


def test_fused_rows_do_not_depend_on_batch_or_chunks() -> None:
    model = demo_shaped_model(num_layers=2, dtype=torch.bfloat16)
    alone, chunked = request_a_alone_and_chunked(model)
    assert torch.equal(chunked, alone)


def test_demo_checkpoint_fused_close_to_unfused(demo_int4_dir: Path) -> None:
    from modelship.engine.tokenizer import load_tokenizer

    model = load_model(demo_int4_dir)
    assert model.fused_decoder is not None  # the default on an AVX2 CPU
    text = "The history of the city of Rome begins with the founding of a small settlement"
    prompt = torch.tensor(load_tokenizer(demo_int4_dir)(text).input_ids)
    n = len(prompt)
    steps = [[([0, 1], prompt[: n - 1], 0)], [([0, 1], prompt[n - 1 :], n - 1)]]
    fused, _ = run(model, steps, fused=True, num_blocks=4)
    unfused, _ = run(model, steps, fused=False, num_blocks=4)
    for f, u in zip(fused, unfused, strict=True):
        # 30 layers of int8 noise, and a bf16 residual stream on the unfused path
        assert (f.float() - u.float()).norm() < 0.1 * u.float().norm()
        logprobs_f = model.compute_logits(f).log_softmax(-1)
        logprobs_u = model.compute_logits(u).log_softmax(-1)
        kl = (logprobs_u.exp() * (logprobs_u - logprobs_f)).sum(-1)  # per token
        assert kl.mean() < 0.05
    assert (logprobs_f.argmax(-1) == logprobs_u.argmax(-1)).all()  # the next token


def test_unfusable_models_keep_the_python_path(tiny_llama_dir: Path) -> None:
    # fp16 compute: the op's activations are bf16 or fp32 (dense bf16 is fused: test_dense_cpu)
    assert load_model(tiny_llama_dir, dtype=torch.float16).fused_decoder is None
    model = demo_shaped_model(num_layers=1)
    o_proj = model.layers[0].o_proj  # a bias on o_proj: not in the fused op
    o_proj.bias = nn.Parameter(torch.zeros(o_proj.out_features), requires_grad=False)
    assert not model.use_fused_decoder() and model.fused_decoder is None
