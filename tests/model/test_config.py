"""`ModelConfig` from the config.json shapes transformers 4 and 5 write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modelship.model import ModelConfig, ModelConfigError, kv_cache_bytes_per_block
from modelship.model.layers import rope_inv_freq

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 97,
    "max_position_embeddings": 256,
}
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def test_defaults_and_derived_fields() -> None:
    config = ModelConfig.from_dict({**LLAMA, "eos_token_id": [2, 7], "torch_dtype": "float16"})
    assert (config.head_dim, config.num_kv_heads, config.q_size, config.kv_size) == (16, 2, 64, 32)
    assert config.eos_token_ids == (2, 7)
    assert config.checkpoint_dtype == torch.float16
    assert config.rope_scaling is None and config.rope_type == "default"
    assert config.rope_theta == 10000.0
    assert not config.qkv_bias and not config.qk_norm and config.quantization_config is None


@pytest.mark.parametrize(
    "rope_fields",
    [
        # transformers 5: everything under rope_parameters
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING}},
        # transformers 4: rope_theta + rope_scaling (old "type" key)
        {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3_SCALING}},
    ],
)
def test_llama3_rope_in_both_layouts(rope_fields: dict) -> None:
    config = ModelConfig.from_dict({**LLAMA, **rope_fields})
    assert config.rope_theta == 500000.0
    assert config.rope_type == "llama3"
    assert config.rope_scaling is not None and config.rope_scaling["factor"] == 8.0
    plain = ModelConfig.from_dict({**LLAMA, "rope_theta": 500000.0})
    scaled, unscaled = rope_inv_freq(config), rope_inv_freq(plain)
    # high frequencies untouched, the lowest divided by the factor
    assert scaled[0] == unscaled[0]
    torch.testing.assert_close(scaled[-1], unscaled[-1] / 8.0)


def test_default_rope_parameters_mean_no_scaling() -> None:
    config = ModelConfig.from_dict(
        {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
    )
    assert config.rope_scaling is None and config.rope_theta == 100000.0


def test_qwen_flags() -> None:
    qwen2 = ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_dict(
        {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32, "attention_bias": False}
    )
    assert qwen3.qk_norm and not qwen3.qkv_bias
    assert (qwen3.head_dim, qwen3.q_size, qwen3.kv_size) == (32, 128, 64)


def test_errors_name_the_file_and_field(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"config\.json: not found"):
        ModelConfig.from_dir(tmp_path)
    broken = {key: value for key, value in LLAMA.items() if key != "vocab_size"}
    (tmp_path / "config.json").write_text(json.dumps(broken))
    with pytest.raises(ModelConfigError, match=r"config\.json: missing field 'vocab_size'"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(ModelConfigError, match="multiple of num_key_value_heads"):
        ModelConfig.from_dict({**LLAMA, "num_key_value_heads": 3})
    with pytest.raises(ModelConfigError, match=r"rope_type 'yarn' is not supported.*llama3"):
        ModelConfig.from_dict({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_kv_cache_bytes_per_block_counts_all_layers() -> None:
    config = ModelConfig.from_dict(LLAMA)
    # 2 (K and V) * 2 layers * 16 tokens * 2 kv heads * 16 dims * 4 bytes
    assert kv_cache_bytes_per_block(config, 16, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4
    assert kv_cache_bytes_per_block(config, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 16 * 2
