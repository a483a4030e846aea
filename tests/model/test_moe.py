"""Mixture-of-experts models (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE) against transformers on
tiny random weights: logits, expert choice per token, and the engine's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelship import LLM, SamplingParams
from modelship.model import AttentionMetadata, allocate_kv_cache, load_model
from modelship.model.config import ModelConfig
from modelship.model.moe import MoEMLP
from paged_model import BACKENDS, BLOCK, random_ids, run

from tiny_models import save_tiny_moe

CASES = [
    ("mixtral", {}),
    ("olmoe", {}),
    ("olmoe", {"norm_topk_prob": True, "clip_qkv": 0.5}),
    ("qwen3_moe", {}),
    # a dense layer between routed ones, top-k renormalized
    ("qwen3_moe", {"norm_topk_prob": True, "mlp_only_layers": [1], "num_hidden_layers": 3}),
    ("qwen2_moe", {}),  # with the sigmoid-gated shared expert
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("kind", "overrides"), CASES)
def test_logits_match_transformers(
    kind: str, overrides: dict, backend: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny_moe(kind, tmp_path / kind, **overrides)
    model = load_model(folder, dtype=torch.float32)
    assert model.config.moe is not None
    routed = [isinstance(layer.mlp, MoEMLP) for layer in model.layers]
    assert routed == [i not in overrides.get("mlp_only_layers", ()) for i in range(len(routed))]
    ids = random_ids(37, model.config.vocab_size)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(ids.unsqueeze(0)).logits[0]

    one_shot = run(model, [(ids, 0)], [5, 2, 9, 0, 7, 1, 12, 3, 4, 6], backend)
    torch.testing.assert_close(one_shot, expected, atol=1e-4, rtol=1e-4)
    # Two prefill chunks (the second reads the first through a scattered block table),
    # then decode one token at a time.
    steps = [(ids[:9], 0), (ids[9:30], 9), *[(ids[i : i + 1], i) for i in range(30, 37)]]
    chunked = run(model, steps, [11, 3, 8, 0, 6, 2, 14, 9, 1, 20], backend)
    torch.testing.assert_close(chunked, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe"])
def test_routing_equals_transformers_expert_choice(kind: str, tmp_path: Path) -> None:
    """Every layer sends every token of a two-sequence batch to the experts transformers picks."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_moe(kind, tmp_path / kind, norm_topk_prob=True)
    model = load_model(folder, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = [random_ids(n, model.config.vocab_size, seed) for seed, n in ((3, 11), (4, 7))]

    ours: list[torch.Tensor] = []
    for layer in model.layers:  # our router: (weights, experts)
        layer.mlp.gate.register_forward_hook(lambda m, i, out: ours.append(out[1]))
    caches = allocate_kv_cache(model.config, 16, BLOCK, torch.float32, "cpu")
    meta = AttentionMetadata.build([11, 7], [11, 7], [[0, 1, 2], [3, 4]], BLOCK, "cpu")
    positions = torch.cat([torch.arange(11), torch.arange(7)])
    with torch.no_grad():
        model(torch.cat(ids), positions, caches, meta)

    theirs: dict[int, list[torch.Tensor]] = {}
    for index, layer in enumerate(reference.model.layers):  # theirs: (logits, scores, experts)
        layer.mlp.gate.register_forward_hook(
            lambda m, i, out, index=index: theirs.setdefault(index, []).append(out[2])
        )
    with torch.no_grad():
        for sequence in ids:  # one sequence at a time: no padding in transformers' batch
            reference(sequence.unsqueeze(0))

    assert len(ours) == len(theirs) == model.config.num_layers
    for layer, choice in enumerate(ours):
        expected = torch.cat(theirs[layer])
        assert choice.shape == (18, 2)
        # token by token, the same experts in the same (descending probability) order
        assert torch.equal(choice, expected), f"layer {layer}"
    assert len(torch.cat(ours).unique()) > 2  # the tokens really spread over the experts


@pytest.mark.parametrize("kind", ["mixtral", "olmoe", "qwen3_moe", "qwen2_moe"])
def test_engine_greedy_equals_generate_with_chunks_and_prefix_cache(
    kind: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny_moe(kind, tmp_path / kind)
    # A token budget of 8 splits every prompt into prefill chunks.
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=8)
    prompt = "Continuous batching schedules requests at iteration granularity. " * 2
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    second = llm.generate(prompt, params)[0]  # the prompt's blocks come from the prefix cache

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
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


def test_moe_config_fields(tmp_path: Path) -> None:
    qwen3 = ModelConfig.from_dir(
        save_tiny_moe("qwen3_moe", tmp_path / "q", mlp_only_layers=[0], num_hidden_layers=3)
    )
    assert qwen3.moe is not None and qwen3.qk_norm and qwen3.qk_norm_scope == "head"
    # transformers 5 writes Qwen3-MoE's expert count as `num_local_experts`
    assert (qwen3.moe.num_experts, qwen3.moe.top_k, qwen3.moe.intermediate_size) == (6, 2, 48)
    assert qwen3.moe.sparse_layers == (1, 2) and not qwen3.moe.normalize_top_k
    mixtral = ModelConfig.from_dir(save_tiny_moe("mixtral", tmp_path / "m"))
    assert mixtral.moe is not None and mixtral.moe.normalize_top_k  # always, whatever the config
    assert mixtral.moe.intermediate_size == 96 and not mixtral.qk_norm
    olmoe = ModelConfig.from_dir(save_tiny_moe("olmoe", tmp_path / "o", clip_qkv=2.0))
    assert olmoe.qk_norm_scope == "full" and olmoe.clip_qkv == 2.0
    qwen2 = ModelConfig.from_dir(save_tiny_moe("qwen2_moe", tmp_path / "q2"))
    assert qwen2.qkv_bias and qwen2.moe is not None and qwen2.moe.shared_intermediate_size == 80


def test_bf16_default_follows_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny_moe("qwen3_moe", tmp_path / "q")
    model = load_model(folder)  # CPU default: bf16 compute, the router included
    assert model.dtype == torch.bfloat16
    assert model.layers[0].mlp.gate.weight.dtype == torch.bfloat16
    ids = random_ids(40, model.config.vocab_size)
    logits = run(model, [(ids[:36], 0), (ids[36:], 36)], list(range(10)), "sdpa")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(ids.unsqueeze(0)).logits[0]
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_tensor_parallel_and_lora_are_refused_by_name(tmp_path: Path) -> None:
    from modelship.model.tensor_parallel import ShardSpec

    folder = save_tiny_moe("mixtral", tmp_path / "m")
    config = ModelConfig.from_dir(folder)
    with pytest.raises(ValueError, match=r"tensor-parallel-size 2.*mixture-of-experts"):
        ShardSpec(config, rank=0, world_size=2)
    model = load_model(folder, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"LoRA.*mixture-of-experts.*MixtralForCausalLM"):
        model.enable_lora()


def test_cuda_graphs_are_declined_with_the_reason(tmp_path: Path) -> None:
    moe = load_model(save_tiny_moe("olmoe", tmp_path / "o"), dtype=torch.float32)
    assert "OlmoeForCausalLM routes tokens to experts" in moe.graph_capture_error()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_stacked_expert_checkpoint_loads_like_per_expert_one(kind: str, tmp_path: Path) -> None:
    """transformers 5 keeps experts stacked in memory; a checkpoint written in that layout
    (gate_up [E, 2I, hidden], down [E, hidden, I]) gives the same model."""
    from safetensors.torch import load_file, save_file

    folder = save_tiny_moe(kind, tmp_path / kind)
    ids = random_ids(12, 320)
    expected = run(load_model(folder, dtype=torch.float32), [(ids, 0)], [0, 1, 2], "sdpa")
    tensors = load_file(folder / "model.safetensors")
    gate, up, down = (
        ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    )
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    for layer in range(2):
        prefix = f"model.layers.{layer}.{block}.experts"
        parts = {
            proj: [tensors.pop(f"{prefix}.{e}.{proj}.weight") for e in range(6)]
            for proj in (gate, up, down)
        }
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(parts[gate], parts[up], strict=True)]
        )
        tensors[f"{prefix}.down_proj"] = torch.stack(parts[down])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    stacked = run(load_model(folder, dtype=torch.float32), [(ids, 0)], [0, 1, 2], "sdpa")
    torch.testing.assert_close(stacked, expected, atol=0, rtol=0)
