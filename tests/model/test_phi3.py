"""Phi-3 / Phi-4 (Phi3ForCausalLM) against transformers on tiny random weights: fused
qkv_proj and gate_up_proj checkpoint tensors, LongRoPE ("su") scaling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelship import LLM, SamplingParams
from modelship.model import load_model
from modelship.model.config import ModelConfig, ModelConfigError
from paged_model import BACKENDS, random_ids, run

from tiny_models import make_tokenizer, tiny_settings

HEAD_DIM = 16  # hidden 64 over 4 heads
PROMPT = "Continuous batching schedules requests at iteration granularity. " * 2


def longrope(original: int, **extra) -> dict:
    """A LongRoPE `rope_scaling` with distinct random short and long factors per frequency."""
    generator = torch.Generator().manual_seed(7)
    short = (1.0 + torch.rand(HEAD_DIM // 2, generator=generator)).tolist()
    long = (2.0 + 4.0 * torch.rand(HEAD_DIM // 2, generator=generator)).tolist()
    return {
        "type": "su",  # older Phi-3 configs' name; transformers reads it as "longrope"
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": original,
        **extra,
    }


def save_tiny_phi3(folder: Path, **overrides) -> Path:
    """A 2-layer random Phi-3 with a trained tokenizer, saved as safetensors: its attention
    and MLP checkpoints hold fused `qkv_proj` and `gate_up_proj` tensors. Norms are
    randomized so they are really exercised."""
    from transformers import Phi3Config, Phi3ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    settings = tiny_settings(tokenizer, **overrides)
    scaling = settings.get("rope_scaling") or {}
    if "original_max_position_embeddings" in scaling:  # the field transformers reads first
        settings["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(**settings))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


CASES = {
    "plain": {},
    # 40 tokens stay within the original length: transformers uses the short factors for
    # the whole forward; factor 256 / 48 scales cos and sin by sqrt(1 + ln(s) / ln(48))
    "longrope": {"rope_scaling": longrope(48)},
    "longrope-attention-factor": {"rope_scaling": longrope(48, attention_factor=1.3)},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case: str, backend: str, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    folder = save_tiny_phi3(tmp_path / case, **CASES[case])
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    model = load_model(folder, dtype=torch.float32)
    ids = random_ids(40, model.config.vocab_size)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(ids.unsqueeze(0)).logits[0]

    one_shot = run(model, [(ids, 0)], [5, 2, 9, 0, 7, 1, 12, 3, 4, 6], backend)
    torch.testing.assert_close(one_shot, expected, atol=1e-4, rtol=1e-4)
    # Two prefill chunks (the second reads the first through a scattered block table),
    # then decode one token at a time.
    steps = [(ids[:9], 0), (ids[9:33], 9), *[(ids[i : i + 1], i) for i in range(33, 40)]]
    chunked = run(model, steps, [11, 3, 8, 0, 6, 2, 14, 9, 1, 20], backend)
    torch.testing.assert_close(chunked, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["plain", "longrope"])
def test_engine_greedy_equals_generate_with_chunks_and_prefix_cache(
    case: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    prompt_tokens = len(make_tokenizer(tmp_path / "tokenizer")(PROMPT).input_ids)
    overrides = {}
    if case == "longrope":
        # The whole sequence stays within the original length (short factors); transformers'
        # generate recomputes the sequence when it crosses it, which the paged cache does not
        # (crossing: test_longrope_past_the_original_length_matches_a_kept_cache).
        original = prompt_tokens + 16
        overrides = {"rope_scaling": longrope(original), "max_position_embeddings": 4 * original}
    folder = save_tiny_phi3(tmp_path / case, **overrides)
    # A token budget of 8 splits every prompt into prefill chunks.
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate(PROMPT, params)[0]
    second = llm.generate(PROMPT, params)[0]  # the prompt's blocks come from the prefix cache

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt_ids = first.prompt_token_ids
    assert len(prompt_ids) == prompt_tokens > 8
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt_ids) :].tolist()
    assert first.outputs[0].token_ids == generated
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= len(prompt_ids) - 4
    assert second.outputs[0].token_ids == generated


@pytest.mark.parametrize("backend", BACKENDS)
def test_longrope_past_the_original_length_matches_a_kept_cache(
    backend: str, tmp_path: Path
) -> None:
    """Across the original length (20) each position keeps the factors it was rotated with:
    equal to transformers' forward over its own KV cache, fed the same steps."""
    from transformers import AutoModelForCausalLM, DynamicCache

    folder = save_tiny_phi3(tmp_path / "p", rope_scaling=longrope(20), max_position_embeddings=80)
    model = load_model(folder, dtype=torch.float32)
    ids = random_ids(30, model.config.vocab_size)
    steps = [(ids[:16], 0), *[(ids[i : i + 1], i) for i in range(16, 24)], (ids[24:], 24)]
    ours = run(model, steps, [3, 1, 4, 0, 5, 9, 2, 6], backend)

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cache = DynamicCache(config=reference.config)
    expected = []
    with torch.no_grad():
        for chunk, start in steps:
            positions = torch.arange(start, start + len(chunk)).unsqueeze(0)
            out = reference(chunk.unsqueeze(0), past_key_values=cache, position_ids=positions)
            expected.append(out.logits[0])
    torch.testing.assert_close(ours, torch.cat(expected), atol=1e-4, rtol=1e-4)
    # the long factors really apply from position 20: a whole-sequence forward (long factors
    # everywhere) disagrees with the first 20 positions' logits
    with torch.no_grad():
        whole = reference(ids.unsqueeze(0)).logits[0]
    assert (whole[:20] - ours[:20]).abs().max() > 1e-3


def test_longrope_config_fields_and_refusals(tmp_path: Path) -> None:
    folder = save_tiny_phi3(tmp_path / "p", rope_scaling=longrope(48))
    config = ModelConfig.from_dir(folder)
    assert config.architecture == "Phi3ForCausalLM" and config.rope_type == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == 48
    assert config_json(folder)["original_max_position_embeddings"] == 48

    raw = config_json(folder)
    raw["rope_parameters"] = {"rope_theta": 10000.0}  # the pre-transformers-5 layout
    raw["rope_scaling"] = longrope(48)
    del raw["rope_scaling"]["original_max_position_embeddings"]
    raw["original_max_position_embeddings"] = 48  # Phi-3 keeps it beside max_position_embeddings
    assert ModelConfig.from_dict(raw).rope_scaling["original_max_position_embeddings"] == 48
    raw["rope_scaling"]["long_factor"] = [1.0] * 3
    with pytest.raises(ModelConfigError, match=r"rope_scaling.long_factor must list .* 8 numbers"):
        ModelConfig.from_dict(raw)
    raw["rope_scaling"] = None
    raw["partial_rotary_factor"] = 0.75  # Phi-4-mini
    with pytest.raises(ModelConfigError, match=r"partial_rotary_factor 0.75 is not supported"):
        ModelConfig.from_dict(raw)


def config_json(folder: Path) -> dict:
    import json

    return json.loads((folder / "config.json").read_text())


def test_tensor_parallel_ranks_slice_the_fused_tensors(tmp_path: Path) -> None:
    """Under --tensor-parallel-size 2 each rank takes its heads' rows of the split qkv_proj
    and its slice of gate_up_proj's halves: greedy tokens equal transformers' generate."""
    from transformers import AutoModelForCausalLM

    from modelship.engine.config import EngineConfig
    from modelship.engine.llm_engine import LLMEngine

    folder = save_tiny_phi3(tmp_path / "p", rope_scaling=longrope(64))
    prompt = random_ids(13, 320, seed=5).tolist()
    engine = LLMEngine(
        folder,
        EngineConfig(dtype="float32", block_size=4, num_kv_blocks=64, tensor_parallel_size=2),
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        engine.add_request("r", prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished():
            for delta in engine.step():
                tokens.extend(delta.token_ids)
    finally:
        engine.close()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
    assert tokens == generated
