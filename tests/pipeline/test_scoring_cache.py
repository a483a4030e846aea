"""The scorer's KV cache holds a whole sequence of its max_model_len for any model: a fixed
64 MiB held 1,456 tokens of the demo model (30 layers, float32 on CPU), under 2,048, and
select failed on `modelship run demo` with KVCacheTooSmallError."""

import json

from modelship.engine import EngineConfig
from modelship.engine.worker import check_one_sequence_fits, planned_cache_tokens
from modelship.pipeline.select.quality import scoring_cache_bytes

DEMO_SHAPED = {  # the demo model's (SmolLM2-135M) attention shape; no weights are read
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


def test_the_scoring_cache_holds_one_sequence_of_a_deep_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEMO_SHAPED))
    for max_model_len in (2048, 8192):
        config = EngineConfig(max_model_len=max_model_len)
        sized = EngineConfig(
            max_model_len=max_model_len,
            kv_cache_memory_bytes=scoring_cache_bytes(tmp_path, config),
        )
        tokens, length = planned_cache_tokens(tmp_path, sized)
        check_one_sequence_fits(tokens, length)  # raises KVCacheTooSmallError otherwise
        assert tokens >= max_model_len


def test_a_small_model_keeps_the_64_mib_floor(tmp_path):
    small = {**DEMO_SHAPED, "num_hidden_layers": 2, "num_key_value_heads": 1}
    (tmp_path / "config.json").write_text(json.dumps(small))
    assert scoring_cache_bytes(tmp_path, EngineConfig(max_model_len=2048)) == 64 * 1024**2
