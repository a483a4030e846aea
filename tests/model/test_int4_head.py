"""The 4-bit output head and tied embedding (`quant.int4_head`): the packing read back row by
row, the round-to-nearest grid, logits against a plain-torch reference, the tied table
dropped, and on the demo model the 4-bit head against the int8 head it would replace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelship.model import AttentionMetadata, allocate_kv_cache, cpu_kernels, load_model
from modelship.model.quant.int4 import dequantize
from modelship.model.quant.int4_head import HEAD_GROUP_SIZE, Int4Head, quantize_rtn

from tiny_models import make_tiny_llama

needs_w4a8 = pytest.mark.skipif(
    not cpu_kernels.load(), reason="modelship's W4A8 kernel needs an AVX2 CPU and a compiler"
)


def ref_rows(u, scale, zero_point, rows: torch.Tensor) -> torch.Tensor:
    """What `pack_q4` stores, dequantized in plain torch: u * scale + min with scale and
    min = -(8 + zero_point) * scale rounded to fp16."""
    groups = scale.shape[1]
    s16 = scale.float().half().float()
    m16 = (-(8 + zero_point.float()) * scale.float()).half().float()
    u = u[rows].float().view(len(rows), groups, -1)
    return (u * s16[rows].unsqueeze(-1) + m16[rows].unsqueeze(-1)).view(len(rows), -1)


@needs_w4a8
def test_looked_up_rows_read_back_what_was_packed() -> None:
    gen = torch.Generator().manual_seed(0)
    out_features, in_features = 37, 192  # 5 blocks of 8 rows, the last one padded
    u = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    scale = torch.rand(out_features, 3, generator=gen) * 0.05 + 0.01
    zero_point = torch.randn(out_features, 3, generator=gen) * 3  # float: asymmetric RTN's
    packed = cpu_kernels.pack_q4(u, scale, zero_point)
    rows = torch.tensor([0, 7, 8, 36, 36, 13, 1])  # block edges, the last row, a repeat
    actual = cpu_kernels.dequantize_q4_rows(*packed, rows)
    assert actual.dtype == torch.float32 and actual.shape == (7, in_features)
    assert torch.equal(actual, ref_rows(u, scale, zero_point, rows))


def test_round_to_nearest_is_within_half_a_step_of_the_weights() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(24, 128, generator=gen) * 0.05
    weight[3, 64:] = 0.25  # a constant group: kept exactly
    u, scale, zero_point = quantize_rtn(weight, HEAD_GROUP_SIZE)
    assert u.min() >= 0 and u.max() <= 15 and (u == 0).any() and (u == 15).any()
    restored = dequantize(u, scale, zero_point, HEAD_GROUP_SIZE)
    step = scale.repeat_interleave(HEAD_GROUP_SIZE, dim=1)
    # half a step, plus the fp16 rounding of the group's minimum
    assert ((restored - weight).abs() <= step / 2 + 1e-4).all()
    assert torch.equal(restored[3, 64:], weight[3, 64:].half().float())


@needs_w4a8
def test_int4_head_logits_match_the_dequantized_reference_and_do_not_depend_on_the_batch(
    tiny_llama_dir: Path,
) -> None:
    dense = load_model(tiny_llama_dir, lm_head="dense")
    model = load_model(tiny_llama_dir, lm_head="int4")
    assert isinstance(model.quantized_head, Int4Head)
    assert model.int4_embedding is None  # untied: the embedding table stays as it is
    assert torch.equal(model.embed_tokens.weight, dense.embed_tokens.weight)
    assert model.lm_head.weight.numel() == 0  # the 16-bit head is replaced, not kept beside
    weight = dense.lm_head.weight.float()
    u, scale, zero_point = quantize_rtn(weight, HEAD_GROUP_SIZE)
    hidden = torch.randn(9, weight.shape[1]).bfloat16()
    actual = model.compute_logits(hidden)
    assert actual.dtype == torch.float32 and actual.shape == (9, weight.shape[0])
    exact = hidden.float() @ ref_rows(u, scale, zero_point, torch.arange(len(u))).t()
    # the activations are rounded to int8 per group of 64 (1/254 of the group's amax)
    assert (actual - exact).abs().max() < 0.02 * exact.abs().max()
    for i in (0, 4, 8):
        assert torch.equal(model.compute_logits(hidden[i : i + 1])[0], actual[i])


@needs_w4a8
def test_tied_embeddings_read_the_4bit_rows_and_the_16bit_table_is_freed(
    tmp_path: Path,
) -> None:
    folder = make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    dense = load_model(folder, lm_head="dense")
    int8 = load_model(folder, lm_head="int8")
    model = load_model(folder, lm_head="int4")
    assert model.int4_embedding is model.quantized_head
    assert model.embed_tokens.weight.numel() == 0 and model.dtype == dense.dtype
    ids = torch.tensor([0, 5, 17, 5, len(dense.embed_tokens.weight) - 1])
    u, scale, zero_point = quantize_rtn(dense.embed_tokens.weight, HEAD_GROUP_SIZE)
    assert torch.equal(model.embed(ids), ref_rows(u, scale, zero_point, ids).to(model.dtype))
    assert weight_bytes(model) < weight_bytes(int8) - dense.embed_tokens.weight.nbytes

    caches = allocate_kv_cache(model.config, 8, 16, torch.float32, "cpu")
    meta = AttentionMetadata.build([5], [5], [[1, 2, 3, 4]], 16, "cpu")
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(5), caches, meta))
    assert logits.shape == (5, model.config.vocab_size) and logits.isfinite().all()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.nbytes for t in [*model.parameters(), *model.buffers()])


def test_bad_head_values_name_the_field(tiny_llama_dir: Path) -> None:
    from modelship.engine import EngineConfig

    with pytest.raises(ValueError, match="lm_head 'int2'; supported: auto, int8, int4, dense"):
        load_model(tiny_llama_dir, lm_head="int2")
    with pytest.raises(ValueError, match="lm_head int4 runs on modelship's CPU kernels"):
        EngineConfig(device="cuda", lm_head="int4")
    with pytest.raises(ValueError, match="lm_head must be one of auto, int8, int4, dense"):
        EngineConfig(lm_head="int2")


# The demo model --------------------------------------------------------------------------------
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Photosynthesis is the process by which green plants use sunlight to",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "To make a cup of tea, first boil the water, then",
    "The three primary colors are red, blue and",
    "In 1969, Neil Armstrong became the first person to",
    "Water freezes at 0 degrees Celsius and boils at",
]


def teacher_forced_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32: the next-token logits at every position, one prefill."""
    blocks = -(-len(ids) // 16)
    caches = allocate_kv_cache(model.config, blocks, 16, torch.float32, "cpu")
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(blocks))], 16, "cpu")
    tokens = torch.tensor(ids)
    with torch.no_grad():
        return model.compute_logits(model(tokens, torch.arange(len(ids)), caches, meta))


@needs_w4a8
def test_demo_int4_head_stays_close_to_the_int8_head(demo_int4_dir: Path) -> None:
    """Top-1 agreement with the int8 head over every position of the prompts, and the
    largest logit difference relative to the logits' range at that position.

    This pins that the 4-bit head computes the same function as the int8 one within the
    noise of its rounding, not that its quality is good enough: select decides that. The
    head is quantized without calibration (16 levels per group of 64), so near-ties between
    the top tokens flip. Measured: 91 of 107 positions (85%) agree here; on select's
    held-out passages (the demo gptq variant, 4 x 256 tokens) 76.8% agree at a KL of 0.136
    nats/token from the int8 head, where the int8 head against the dense one agrees on
    96.3% at 0.0045; the largest logit error here is 26% of the logits' range at its
    position (the final hidden state has a few large dimensions, whose columns' rounding
    errors add up). Hence 75% and 40%, margins for other roundings; a layout or sign error
    agrees on ~0% and moves logits by their whole range."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_int4_dir)
    int8 = load_model(demo_int4_dir, lm_head="int8")
    int4 = load_model(demo_int4_dir, lm_head="int4")
    agree = positions = 0
    worst = 0.0
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        expected, actual = teacher_forced_logits(int8, ids), teacher_forced_logits(int4, ids)
        agree += int((expected.argmax(-1) == actual.argmax(-1)).sum())
        positions += len(ids)
        spread = expected.amax(-1) - expected.amin(-1)  # [positions]
        worst = max(worst, float(((actual - expected).abs().amax(-1) / spread).max()))
    print(f"top-1 agreement {agree}/{positions}, max logit error {worst:.3f} of the range")
    assert agree >= 0.75 * positions
    assert worst < 0.4
