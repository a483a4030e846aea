"""The int8 KV cache (`kv_cache.quantize_kv`, the CPU kernels' int8 path, SDPA's gather)
against the fp32 cache on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from modelship.engine import LLMEngine
from modelship.engine.config import EngineConfig
from modelship.engine.sampling_params import SamplingParams
from modelship.model import AttentionMetadata, KVCache, allocate_kv_cache, cpu_kernels, load_model
from modelship.model.attention import paged_attention, resolve_attention_backend
from modelship.model.config import ModelConfig
from modelship.model.kv_cache import dequantize_kv, kv_cache_bytes_per_block, quantize_kv
from modelship.model.quant.base import DenseLinear
from modelship.model.quant.int4 import W4A8Linear

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="needs AVX2 and a compiler")
BLOCK = 16
# Every path the int8 cache takes on a CPU: the attention kernel layer by layer, the fused
# decoder (all layers in one C++ call), and SDPA over dequantized gathers.
PATHS = [
    pytest.param("cpu", marks=needs_kernels),
    pytest.param("fused", marks=needs_kernels),
    "sdpa",
]


def test_quantize_kv_round_trip() -> None:
    x = torch.randn(5, 2, 3, 64, generator=torch.Generator().manual_seed(0))
    x[0, 0, 0] = 0  # an all-zero vector: scale 0, values 0, no NaN
    values, scales = quantize_kv(x)
    assert values.dtype == torch.int8 and scales.shape == (5, 2, 3)
    assert values.abs().amax(-1).flatten()[1:].eq(127).all()  # absmax maps to +-127
    assert scales[0, 0, 0] == 0 and values[0, 0, 0].eq(0).all()
    # round to nearest: at most half a step (scale / 2) off per element
    error = (dequantize_kv(values, scales) - x).abs()
    assert (error <= scales.unsqueeze(-1) / 2 * (1 + 1e-6)).all()


def test_bytes_per_block_count_the_scales() -> None:
    config = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 100,
        }
    )
    fp32 = kv_cache_bytes_per_block(config, BLOCK, torch.float32)
    int8 = kv_cache_bytes_per_block(config, BLOCK, torch.int8)
    assert fp32 == 2 * 30 * BLOCK * 3 * 64 * 4
    assert int8 == 2 * 30 * BLOCK * 3 * (64 + 4)  # int8 values + one fp32 scale per vector
    assert fp32 / int8 == pytest.approx(256 / 68)  # ~3.76x the blocks in the same memory
    caches = allocate_kv_cache(config, 2, BLOCK, torch.int8, "cpu")
    cache = caches[0]
    assert cache.kv.dtype == torch.int8 and cache.dtype == torch.float32
    assert cache.scales is not None and cache.scales.shape == (2 * BLOCK, 2, 3)
    per_block = sum(c.kv.nbytes + c.scales.nbytes for c in caches) // 2
    assert per_block == int8


# -- the kernels' int8 path --------------------------------------------------------------
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 32
STEP = dict(  # decodes between prefills and a prefill chunk after a prefix, scattered blocks
    query_lens=[1, 5, 1, 3],
    seq_lens=[9, 5, 2, 11],
    block_tables=[[7, 2, 12], [3, 9], [15], [0, 14, 5]],
)


def _int8_copy(cache: KVCache) -> KVCache:
    return KVCache(*quantize_kv(cache.kv))


@needs_kernels
def test_kernel_reads_int8_as_its_dequantized_fp32() -> None:
    gen = torch.Generator().manual_seed(1)
    num_tokens = sum(STEP["query_lens"])
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
    kv = torch.randn(num_tokens, 2, KV_HEADS, HEAD_DIM, generator=gen)
    noise = KVCache(torch.randn(16 * 4, 2, KV_HEADS, HEAD_DIM, generator=gen))
    meta = AttentionMetadata.build(**STEP, block_size=4, device="cpu", backend="cpu")
    int8 = _int8_copy(noise)
    out = paged_attention(q, kv, int8, meta, scale=0.3)
    # the step's K/V were quantized into their slots
    values, scales = quantize_kv(kv)
    assert torch.equal(int8.kv[meta.slot_mapping], values)
    assert torch.equal(int8.scales[meta.slot_mapping], scales)
    # the same attention as over an fp32 cache holding the dequantized values
    dequantized = KVCache(dequantize_kv(int8.kv, int8.scales))
    expected = paged_attention(q, dequantize_kv(values, scales), dequantized, meta, scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # and SDPA over the int8 cache agrees
    sdpa_meta = AttentionMetadata.build(**STEP, block_size=4, device="cpu", backend="sdpa")
    sdpa = paged_attention(q, kv, _int8_copy(noise), sdpa_meta, scale=0.3)
    torch.testing.assert_close(sdpa, out, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_rope_kernel_writes_what_quantize_kv_makes_of_the_fp32_write() -> None:
    gen = torch.Generator().manual_seed(2)
    num_tokens = sum(STEP["query_lens"])
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    angles = torch.rand(16, HEAD_DIM, generator=gen) * 6
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    meta = AttentionMetadata.build(**STEP, block_size=4, device="cpu", backend="cpu")
    noise = KVCache(torch.randn(16 * 4, 2, KV_HEADS, HEAD_DIM, generator=gen))
    fp32 = KVCache(dequantize_kv(*quantize_kv(noise.kv)))  # the same context, dequantized
    int8 = _int8_copy(noise)
    expected = cpu_kernels.rope_paged_attention(qkv, fp32, cos, sin, meta, 0.3, HEADS)
    out = cpu_kernels.rope_paged_attention(qkv, int8, cos, sin, meta, 0.3, HEADS)
    values, scales = quantize_kv(fp32.kv[meta.slot_mapping])  # the rotated k and the v
    assert torch.equal(int8.kv[meta.slot_mapping], values)  # bit for bit, same rounding
    assert torch.equal(int8.scales[meta.slot_mapping], scales)
    # attention over int8 vs fp32 keys of the step: int8 rounding only (~1/254 of absmax)
    assert (out - expected).norm() < 0.02 * expected.norm()
    assert not torch.equal(out, expected)  # it did read the int8 values


def test_triton_backend_refuses_an_int8_cache() -> None:
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match=r"no torch\.int8 KV cache"):
        resolve_attention_backend("triton", "cuda", torch.int8)
    assert resolve_attention_backend("auto", "cuda", torch.int8) == "sdpa"
    expected = "cpu" if cpu_kernels.load() else "sdpa"
    assert resolve_attention_backend("auto", "cpu", torch.int8) == expected


# -- the tiny model: int8 vs fp32 cache --------------------------------------------------


def _quantize_to_w4a8(model: nn.Module) -> None:
    """Every dense projection of the tiny model to a W4A8 linear (round to nearest, group
    64), so that the fused decoder can run it."""
    for layer in model.layers:
        for owner, name in (
            (layer, "qkv_proj"),
            (layer, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            dense = getattr(owner, name)
            assert isinstance(dense, DenseLinear)
            weight = dense.weight.float()
            groups = weight.view(weight.shape[0], -1, 64)
            scale = groups.abs().amax(-1) / 7  # [out, in / 64]
            u = (groups / scale.unsqueeze(-1)).round().clamp(-8, 7) + 8
            zero = torch.zeros_like(scale, dtype=torch.int32)
            linear = W4A8Linear.from_unpacked(
                u.view_as(weight).to(torch.int32), scale, zero, 64, dense.bias
            )
            setattr(owner, name, linear)
    assert model.use_fused_decoder()


def _tiny_model(tiny_llama_dir: Path, path: str) -> nn.Module:
    model = load_model(tiny_llama_dir, dtype="float32")
    if path == "fused":
        _quantize_to_w4a8(model)
    else:  # the per-layer path, which a dense checkpoint leaves for the fused one by default
        model.fused_decoder = None
    return model


def _logits_per_step(
    model: nn.Module, token_ids: torch.Tensor, prefill: int, cache_dtype: torch.dtype, path: str
) -> tuple[torch.Tensor, list[KVCache]]:
    """Prefill `prefill` tokens in one step, then one decode step per remaining token:
    [1 + len - prefill, vocab] fp32 logits (the prefill's last row, then each decode's)."""
    backend = "sdpa" if path == "sdpa" else "cpu"
    caches = allocate_kv_cache(model.config, 8, BLOCK, cache_dtype, "cpu")
    table = [5, 2, 7, 0]  # scattered blocks
    steps = [(0, prefill)] + [(i, i + 1) for i in range(prefill, len(token_ids))]
    logits = []
    with torch.inference_mode():
        for start, end in steps:
            meta = AttentionMetadata.build([end - start], [end], [table], BLOCK, "cpu", backend)
            hidden = model(token_ids[start:end], torch.arange(start, end), caches, meta)
            logits.append(model.compute_logits(hidden[-1:]))
    return torch.cat(logits), caches


# The tiny model's random weights give near-uniform next-token distributions (logits of
# std ~0.15). An int8 element is off by at most half a step, absmax / 254. Measured here:
# the int8 cache moves any log-probability by 0.7e-3 to 1.0e-3 on the kernel and SDPA and
# by 1.4e-3 to 3.5e-3 through the fused decoder (its int8 activations turn the cache's
# noise into an occasional flipped rounding downstream). 1e-2 leaves room for other seeds
# and still fails for a misread cache (a dropped scale or a swapped k/v moves log-probs by
# about the logits' whole spread).
MAX_LOGPROB_ERROR = 1e-2


@pytest.mark.parametrize("path", PATHS)
def test_int8_logits_close_to_fp32_after_prefill_and_decodes(
    tiny_llama_dir: Path, path: str
) -> None:
    model = _tiny_model(tiny_llama_dir, path)
    token_ids = torch.randint(0, 300, (48,), generator=torch.Generator().manual_seed(4))
    expected, _ = _logits_per_step(model, token_ids, 40, torch.float32, path)
    actual, caches = _logits_per_step(model, token_ids, 40, torch.int8, path)
    assert caches[0].kv.dtype == torch.int8 and caches[0].scales.abs().sum() > 0
    assert actual.shape == (9, model.config.vocab_size)  # after the prefill, 8 decodes
    error = (actual.log_softmax(-1) - expected.log_softmax(-1)).abs().amax(-1)  # per step
    assert error.max() < MAX_LOGPROB_ERROR
    assert error.min() > 0  # the int8 cache was read, not an fp32 copy
    # the spread the bound is measured against: int8 noise is a small part of it
    assert expected.std(-1).min() > 10 * MAX_LOGPROB_ERROR


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_greedy_tokens_match_the_fp32_cache(tiny_llama_dir: Path, backend: str) -> None:
    prompts = [
        "The quick brown fox jumps over the lazy dog.",
        "Paged attention reads keys and values",
        "Models are served from files on shared storage",
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = {}
    for dtype in ("float32", "int8"):
        config = EngineConfig(kv_cache_dtype=dtype, attention_backend=backend, num_kv_blocks=32)
        engine = LLMEngine(tiny_llama_dir, config)
        assert engine.kv_caches[0].kv.dtype == getattr(torch, dtype)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        outputs[dtype] = [tokens[f"r{i}"] for i in range(len(prompts))]
    for fp32, int8 in zip(outputs["float32"], outputs["int8"], strict=True):
        assert len(fp32) == len(int8) == 32
    # Measured: every token agrees on both backends (the int8 noise, ~1e-3 in log-prob, is
    # smaller than the gaps between the tiny model's top two logits along these prompts).
    assert outputs["int8"] == outputs["float32"]


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_cache_holds_more_blocks_in_the_same_memory(
    tiny_llama_dir: Path, dtype: str
) -> None:
    blocks = {}
    for kv_dtype in ("float32", dtype):
        config = EngineConfig(kv_cache_dtype=kv_dtype, kv_cache_memory_bytes=2 * 1024**2)
        blocks[kv_dtype] = LLMEngine(tiny_llama_dir, config).block_manager.num_blocks
    # the tiny model's head_dim is 16: 64 bytes per fp32 vector, 16 + 4 (scale) per 8-bit one
    assert blocks[dtype] / blocks["float32"] >= 2
    assert blocks[dtype] / blocks["float32"] == pytest.approx(64 / 20, rel=0.01)


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_prefix_cache_hit_on_int8_gives_the_same_continuation(
    tiny_llama_dir: Path, backend: str
) -> None:
    config = EngineConfig(kv_cache_dtype="int8", attention_backend=backend, num_kv_blocks=32)
    engine = LLMEngine(tiny_llama_dir, config)
    prompt = list(range(3, 3 + 3 * BLOCK + 5))  # three full blocks (cacheable) and a tail
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def generate(request_id: str) -> list[int]:
        engine.add_request(request_id, prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished():
            for delta in engine.step():
                tokens.extend(delta.token_ids)
        return tokens

    first = generate("first")
    hits = engine.stats().prefix_cache_hits
    second = generate("second")  # reads the first's int8 blocks and their scales
    assert engine.stats().prefix_cache_hits > hits
    assert len(first) == 16 and second == first
    engine.block_manager.check_integrity()
