"""Gemma 2 and Gemma 3 text against transformers on tiny random weights: scaled
embeddings, (1 + weight) sandwich norms, GeGLU, query_pre_attn_scalar, attention and final
logit soft-capping, sliding-window layers (a window of 8 that bites in every test); Gemma 3's
q/k norms and local RoPE base."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from modelship import LLM, SamplingParams
from modelship.model import AttentionMetadata, allocate_kv_cache, cpu_kernels, load_model
from paged_model import BLOCK, random_ids, run

from tiny_models import save_tiny_gemma2

BACKENDS = [
    "sdpa",
    pytest.param(
        "cpu",  # the CPU kernel's metadata: the model reads K/V through it in PyTorch
        marks=pytest.mark.skipif(not cpu_kernels.load(), reason="needs AVX2 and a compiler"),
    ),
]


def reference_model(folder: Path):
    from transformers import AutoModelForCausalLM

    # eager: transformers' SDPA path cannot soft-cap either
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_transformers(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = save_tiny_gemma2(tmp_path / "g")
    with caplog.at_level(logging.INFO, logger="modelship.model.gemma"):
        model = load_model(folder, dtype=torch.float32)
    assert "attention runs in PyTorch ops" in caplog.text
    assert model.lm_head is None  # tied embeddings
    assert "walks the step's requests on the host" in model.graph_capture_error()
    assert [layer.window for layer in model.layers] == [8, None]
    ids = random_ids(37, model.config.vocab_size)
    reference = reference_model(folder)
    with torch.no_grad():
        expected = reference(ids.unsqueeze(0)).logits[0]
    assert expected.abs().max() > 0.5 * 0.5  # the final cap (0.5) really bites

    one_shot = run(model, [(ids, 0)], [5, 2, 9, 0, 7, 1, 12, 3, 4, 6], backend)
    torch.testing.assert_close(one_shot, expected, atol=1e-4, rtol=1e-4)
    steps = [(ids[:9], 0), (ids[9:30], 9), *[(ids[i : i + 1], i) for i in range(30, 37)]]
    chunked = run(model, steps, [11, 3, 8, 0, 6, 2, 14, 9, 1, 20], backend)
    torch.testing.assert_close(chunked, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_engine_greedy_equals_generate_with_chunks_and_prefix_cache(
    kind: str, tmp_path: Path
) -> None:
    folder = save_tiny_gemma2(tmp_path / kind, kind)
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=8)
    prompt = "Continuous batching schedules requests at iteration granularity. " * 2
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    second = llm.generate(prompt, params)[0]  # the prompt's blocks come from the prefix cache

    reference = reference_model(folder)
    prompt_ids = first.prompt_token_ids
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt_ids) :].tolist()
    assert len(prompt_ids) > 8
    assert first.outputs[0].token_ids == generated
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= len(prompt_ids) - 4
    assert second.outputs[0].token_ids == generated


def test_layer_types_pick_the_sliding_layers(tmp_path: Path) -> None:
    folder = save_tiny_gemma2(
        tmp_path / "g", layer_types=["full_attention", "sliding_attention"], sliding_window=5
    )
    model = load_model(folder, dtype=torch.float32)
    assert [layer.window for layer in model.layers] == [None, 5]
    ids = random_ids(23, model.config.vocab_size)
    with torch.no_grad():
        expected = reference_model(folder)(ids.unsqueeze(0)).logits[0]
    steps = [(ids[:10], 0), *[(ids[i : i + 1], i) for i in range(10, 23)]]
    torch.testing.assert_close(run(model, steps, list(range(6)), "sdpa"), expected,
                               atol=1e-4, rtol=1e-4)  # fmt: skip


# "triton": the Triton kernel's metadata (the model never calls the kernel, so no GPU needed)
@pytest.mark.parametrize("backend", [*BACKENDS, "triton"])
def test_mixed_batch_of_decodes_and_a_chunk_matches_each_sequence_alone(
    backend: str, tmp_path: Path
) -> None:
    """Three requests share steps: prefills first, then one step with two decode tokens of
    different context lengths (padded decode batch) and a later prefill chunk."""
    folder = save_tiny_gemma2(tmp_path / "g")
    model = load_model(folder, dtype=torch.float32)
    reference = reference_model(folder)
    vocab = model.config.vocab_size
    seqs = [random_ids(n, vocab, seed) for seed, n in ((3, 12), (4, 7), (5, 14))]
    tables = [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9]]
    caches = allocate_kv_cache(model.config, 16, BLOCK, torch.float32, "cpu")

    def step(parts):  # parts: [(request, start, end)]
        meta = AttentionMetadata.build(
            [end - start for _, start, end in parts],
            [end for _, _, end in parts],
            [tables[r] for r, _, _ in parts],
            BLOCK,
            "cpu",
            backend,
        )
        ids = torch.cat([seqs[r][start:end] for r, start, end in parts])
        positions = torch.cat([torch.arange(start, end) for _, start, end in parts])
        with torch.no_grad():
            return model.compute_logits(model(ids, positions, caches, meta))

    step([(0, 0, 11), (1, 0, 6), (2, 0, 9)])
    mixed = step([(0, 11, 12), (2, 9, 14), (1, 6, 7)])  # decode, chunk, decode
    with torch.no_grad():
        expected = [reference(s.unsqueeze(0)).logits[0] for s in seqs]
    torch.testing.assert_close(mixed[0], expected[0][11], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[1:6], expected[2][9:14], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[6], expected[1][6], atol=1e-4, rtol=1e-4)


def test_bf16_default_follows_transformers(tmp_path: Path) -> None:
    folder = save_tiny_gemma2(tmp_path / "g")
    model = load_model(folder)  # CPU default: bf16 compute; attention itself in fp32
    assert model.dtype == torch.bfloat16
    ids = random_ids(40, model.config.vocab_size)
    logits = run(model, [(ids[:36], 0), (ids[36:], 36)], list(range(10)), "sdpa")
    with torch.no_grad():
        expected = reference_model(folder)(ids.unsqueeze(0)).logits[0]
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma3_logits_match_transformers(backend: str, tmp_path: Path) -> None:
    folder = save_tiny_gemma2(tmp_path / "g3", "gemma3")
    model = load_model(folder, dtype=torch.float32)
    assert [layer.window for layer in model.layers] == [8, 8, None]
    assert [layer.local_rope for layer in model.layers] == [True, True, False]
    assert model.config.qk_norm and model.config.local_rope_theta == 1e4
    ids = random_ids(37, model.config.vocab_size)
    with torch.no_grad():
        expected = reference_model(folder)(ids.unsqueeze(0)).logits[0]
    steps = [(ids[:9], 0), (ids[9:30], 9), *[(ids[i : i + 1], i) for i in range(30, 37)]]
    chunked = run(model, steps, [11, 3, 8, 0, 6, 2, 14, 9, 1, 20], backend)
    torch.testing.assert_close(chunked, expected, atol=1e-4, rtol=1e-4)


def test_gemma3_older_config_fields(tmp_path: Path) -> None:
    """Gemma-3-1B's config.json as released: rope_local_base_freq, rope_scaling and
    sliding_window_pattern instead of per-layer-type rope_parameters and layer_types."""
    import json

    from modelship.model.config import ModelConfig

    raw = json.loads((save_tiny_gemma2(tmp_path / "g3", "gemma3") / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        del raw[key]
    raw.update(
        num_hidden_layers=7,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=6,
    )
    config = ModelConfig.from_dict(raw)
    assert config.layer_types == ("sliding_attention",) * 5 + (
        "full_attention",
        "sliding_attention",
    )
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.rope_type == "linear" and config.rope_scaling["factor"] == 8.0
