"""Dense weights on modelship's CPU kernels (`csrc/dense_cpu.cpp`): the `dense_linear` op
against a float64 reference, its rows independent of the batch, and dense checkpoints in the
fused decoder against the per-layer path and against transformers' eager bf16 model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from demo_shaped import MIXED_STEPS, demo_shaped_model, ids, request_a_alone_and_chunked, run
from modelship.model import cpu_kernels, load_model
from modelship.model.llama import LlamaForCausalLM
from modelship.model.quant.base import DenseLinear

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="needs AVX2 and a compiler")

WEIGHT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 6, 7, 16, 19, 33])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 100), (64, 576), (13, 1100)])
def test_dense_linear_matches_a_float64_reference(
    dtype: torch.dtype, num_rows: int, out_features: int, in_features: int
) -> None:
    # 37 outputs: tiles of 4 / 2 columns and single ones, AVX-512 groups of 8 then 5 (an odd
    # row in the last pair); 100 inputs: an 8-wide loop, then 4; 1100: three K blocks, then 4
    weight = random(out_features, in_features, seed=1).to(dtype)
    x = random(num_rows, in_features, seed=2)
    bias = random(out_features, seed=3)
    expected = x.double() @ weight.double().T + bias.double()
    actual = cpu_kernels.dense_linear(x, weight, bias)
    assert actual.dtype == torch.float32 and actual.shape == (num_rows, out_features)
    # fp32 accumulation over up to 1100 products of unit-scale values: rounding reaches ~1e-5
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-4)


# (outputs, inputs): whole and partial 8-row groups (1, 2, 7 rows in the last one), K below
# one 8-column step, with a tail, and over several K blocks of 512 columns
ISA_SHAPES = [(8, 64), (41, 100), (3, 5), (18, 1100), (57, 576)]


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), ISA_SHAPES)
def test_every_tile_gives_the_avx2_tiles_bits(
    dtype: torch.dtype, out_features: int, in_features: int
) -> None:
    """Rows 1 .. 33 (every remainder of the 6-row AVX-512 tiles, the 4-row AVX2 ones and the
    memory-bound few-row tiles) give bitwise the AVX2 tiles' result, and each row alone
    (the decode path) gives the same bits as it does in a batch of 33."""
    weight = random(out_features, in_features, seed=6).to(dtype)
    x = random(33, in_features, seed=7)
    batched = cpu_kernels.dense_linear(x, weight, None)
    assert torch.equal(cpu_kernels.dense_linear(x, weight, None, isa="avx2"), batched)
    for num_rows in range(1, 34):
        rows = cpu_kernels.dense_linear(x[-num_rows:], weight, None)
        assert torch.equal(rows, batched[-num_rows:]), num_rows


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_prefill_sized_batches_keep_each_rows_bits(dtype: torch.dtype) -> None:
    # 131 rows: the AVX-512 path's blocks of 128 rows, then 3
    weight = random(50, 1100, seed=8).to(dtype)
    x = random(131, 1100, seed=9)
    batched = cpu_kernels.dense_linear(x, weight, None)
    assert torch.equal(cpu_kernels.dense_linear(x, weight, None, isa="avx2"), batched)
    for start, size in [(0, 1), (127, 1), (130, 1), (5, 128), (100, 31)]:
        rows = cpu_kernels.dense_linear(x[start : start + size], weight, None)
        assert torch.equal(rows, batched[start : start + size]), (start, size)


def test_dense_linear_names_an_unknown_isa() -> None:
    with pytest.raises(RuntimeError, match="isa"):
        cpu_kernels.dense_linear(random(2, 8, seed=1), random(4, 8, seed=2), None, isa="sse")


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_dense_linear_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    weight = random(101, 576, seed=4).to(dtype)
    x = random(21, 576, seed=5).to(torch.bfloat16)
    batched = cpu_kernels.dense_linear(x, weight, None)
    for m in range(21):  # each row alone: the memory-bound single-row tiles
        assert torch.equal(cpu_kernels.dense_linear(x[m : m + 1], weight, None), batched[m : m + 1])
    for start, size in [(0, 2), (3, 3), (6, 4), (10, 5), (2, 16)]:  # other tile mixes
        rows = cpu_kernels.dense_linear(x[start : start + size], weight, None)
        assert torch.equal(rows, batched[start : start + size])


def random_dense(
    out_features: int, in_features: int, gen: torch.Generator, bias: bool, dtype: torch.dtype
) -> nn.Module:
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = 0.1 * torch.randn(out_features, generator=gen) if bias else None
    return DenseLinear(weight.to(dtype), None if b is None else b.to(dtype))


def dense_demo_shaped_model(num_layers: int, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """The demo model's shapes with random dense weights, a q/k/v bias, all in `dtype`."""
    return demo_shaped_model(random_dense, num_layers, qkv_bias=True, dtype=dtype, seed=seed)


def hidden_states(model, steps, fused: bool) -> list[torch.Tensor]:
    return run(model, steps, fused)[0]


def test_fused_dense_layers_match_the_per_layer_path() -> None:
    # fp32 everywhere: both paths run the same matmul kernel; only the glue's fp32 sums differ
    model = dense_demo_shaped_model(num_layers=3, dtype=torch.float32)
    expected = hidden_states(model, MIXED_STEPS, fused=False)
    actual = hidden_states(model, MIXED_STEPS, fused=True)
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_fused_dense_rows_do_not_depend_on_batch_or_chunks() -> None:
    model = dense_demo_shaped_model(num_layers=2, dtype=torch.bfloat16)
    alone, chunked = request_a_alone_and_chunked(model)
    assert torch.equal(chunked, alone)


def test_dense_checkpoint_logits_as_close_as_eager_bf16(tiny_llama_dir: Path) -> None:
    """A dense checkpoint served directly (bf16 on CPU) runs the fused decoder, and its
    logits are as close to transformers' fp32 ones as transformers' own eager bf16 model."""
    from transformers import AutoModelForCausalLM

    model = load_model(tiny_llama_dir)
    assert model.dtype == torch.bfloat16 and model.fused_decoder is not None
    prompt = ids(45, 6) % model.config.vocab_size
    steps = [[([0, 1, 2], prompt[:40], 0)], [([0, 1, 2], prompt[40:], 40)]]
    with torch.inference_mode():
        ours = torch.cat([model.compute_logits(h) for h in hidden_states(model, steps, fused=True)])
        reference = {}
        for dtype in (torch.float32, torch.bfloat16):
            hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=dtype)
            reference[dtype] = hf(prompt.unsqueeze(0)).logits[0].float()
    exact = reference[torch.float32]
    eager_error = (reference[torch.bfloat16] - exact).norm()
    assert (ours - exact).norm() <= 1.5 * eager_error
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
