"""Our model implementations against transformers on the same tiny random weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modelship.model import (
    AttentionMetadata,
    MissingWeightError,
    UnsupportedModelError,
    allocate_kv_cache,
    cpu_kernels,
    load_model,
)
from modelship.model.quant.base import DenseLinear

BLOCK = 4
VOCAB = 97


def save_tiny(kind: str, folder: Path, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A 2-layer random model of `kind` saved as safetensors (extra parts randomized)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if kind == "qwen3":
        settings["head_dim"] = 32  # explicit, != hidden / heads
    settings.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**settings))
    with torch.no_grad():  # random biases/norms so the extra parts are really exercised
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    return folder


def reference_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(ids.unsqueeze(0)).logits[0]


def run(model, steps, block_tables, num_blocks=32, cache_dtype=torch.float32, backend="sdpa"):
    """Run requests step by step through one paged cache.

    steps[s] = [(request, token ids, start position)]; returns each step's logits."""
    caches = allocate_kv_cache(model.config, num_blocks, BLOCK, cache_dtype, "cpu")
    outputs = []
    for step in steps:
        ids = torch.cat([c[1] for c in step])
        positions = torch.cat([torch.arange(c[2], c[2] + len(c[1])) for c in step])
        meta = AttentionMetadata.build(
            [len(c[1]) for c in step],
            [c[2] + len(c[1]) for c in step],
            [block_tables[c[0]] for c in step],
            BLOCK,
            "cpu",
            backend,
        )
        with torch.no_grad():
            outputs.append(model.compute_logits(model(ids, positions, caches, meta)))
    return outputs


def random_ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
]


BACKENDS = [
    "sdpa",
    pytest.param(
        "cpu",  # modelship's kernel: RoPE, cache write and attention in one call
        marks=pytest.mark.skipif(not cpu_kernels.load(), reason="needs AVX2 and a compiler"),
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("kind", "overrides"), CASES)
def test_logits_match_transformers(
    kind: str, overrides: dict, backend: str, tmp_path: Path
) -> None:
    folder = save_tiny(kind, tmp_path / kind, **overrides)
    model = load_model(folder, dtype=torch.float32)
    assert model.config.architecture.lower().startswith(kind)
    ids = random_ids(37)
    expected = reference_logits(folder, ids)

    one_shot = run(model, [[(0, ids, 0)]], {0: [5, 2, 9, 0, 7, 1, 12, 3, 4, 6]}, backend=backend)[0]
    torch.testing.assert_close(one_shot, expected, atol=1e-4, rtol=1e-4)

    # Two chunks (the second reads the first through a scattered block table), then decode.
    chunked = run(
        model,
        [
            [(0, ids[:9], 0)],
            [(0, ids[9:30], 9)],
            *[[(0, ids[i : i + 1], i)] for i in range(30, 37)],
        ],
        {0: [11, 3, 8, 0, 6, 2, 14, 9, 1, 20]},
        backend=backend,
    )
    torch.testing.assert_close(torch.cat(chunked), expected, atol=1e-4, rtol=1e-4)


def test_mixed_batch_equals_one_at_a_time(tmp_path: Path) -> None:
    folder = save_tiny("qwen2", tmp_path / "m")
    model = load_model(folder, dtype=torch.float32)
    a, b, c, d = (random_ids(n, seed) for seed, n in enumerate((13, 6, 9, 11)))
    tables = {0: [0, 1, 2, 3], 1: [4, 5], 2: [6, 7, 8], 3: [12, 10, 9]}
    # Step 1: prefill a, b and the first part of d; step 2: decode a and b between a fresh
    # prefill of c and the second chunk of d.
    batched = run(
        model,
        [
            [(0, a[:-1], 0), (1, b[:-1], 0), (3, d[:4], 0)],
            [(0, a[-1:], 12), (2, c, 0), (1, b[-1:], 5), (3, d[4:], 4)],
        ],
        tables,
    )[1]
    alone = {
        name: run(model, [[(name, ids, 0)]], tables)[0] for name, ids in enumerate((a, b, c, d))
    }
    torch.testing.assert_close(batched[0], alone[0][-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(batched[1:10], alone[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(batched[10], alone[1][-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(batched[11:], alone[3][4:], atol=1e-4, rtol=1e-4)


def test_greedy_decode_matches_transformers_generate(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path / "m")
    prompt = random_ids(7)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        generated = reference.generate(
            prompt.unsqueeze(0), max_new_tokens=8, do_sample=False, pad_token_id=0
        )[0, len(prompt) :]
    model = load_model(folder, dtype=torch.float32)
    caches = allocate_kv_cache(model.config, 8, BLOCK, torch.float32, "cpu")
    tokens, ids, start = [], prompt, 0
    with torch.no_grad():
        for _ in range(8):
            end = start + len(ids)
            meta = AttentionMetadata.build([len(ids)], [end], [[6, 2, 7, 0]], BLOCK, "cpu")
            hidden = model(ids, torch.arange(start, end), caches, meta)
            token = int(model.compute_logits(hidden[-1:]).argmax(-1))
            tokens.append(token)
            ids, start = torch.tensor([token]), end
    assert tokens == generated.tolist()


def test_bf16_default_with_prefill_sized_batches(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "m")
    model = load_model(folder)  # CPU default: bf16 compute
    assert model.dtype == torch.bfloat16
    ids = random_ids(40)  # >= 32 rows: the fp32-upcast matmul path on CPUs without bf16
    expected = reference_logits(folder, ids)
    logits = run(model, [[(0, ids[:36], 0)], [(0, ids[36:], 36)]], {0: list(range(10))})
    logits = torch.cat(logits)
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_fp16_checkpoint_computes_in_requested_dtype(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "m", dtype=torch.float16)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float16"
    model = load_model(folder, dtype="bfloat16")
    assert model.config.checkpoint_dtype == torch.float16 and model.dtype == torch.bfloat16
    qkv = model.layers[0].qkv_proj
    assert isinstance(qkv, DenseLinear) and qkv.weight.dtype == torch.bfloat16
    ids = random_ids(12)
    logits = run(model, [[(0, ids, 0)]], {0: [0, 1, 2]})[0]
    expected = reference_logits(folder, ids)
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_sharded_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny("qwen3", tmp_path / "one")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    ids = random_ids(10)
    logits = run(load_model(sharded, dtype=torch.float32), [[(0, ids, 0)]], {0: [3, 0, 1]})[0]
    torch.testing.assert_close(logits, reference_logits(folder, ids), atol=1e-4, rtol=1e-4)


def test_registry_lists_supported_architectures(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(folder)


def test_missing_weight_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = save_tiny("llama", tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(MissingWeightError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(folder)
