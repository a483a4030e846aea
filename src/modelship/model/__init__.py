"""modelship.model: our PyTorch implementations of the Llama family, loading safetensors."""

from modelship.model.attention import AttentionMetadata
from modelship.model.config import ModelConfig
from modelship.model.kv_cache import KVCache, allocate_kv_cache, kv_cache_bytes_per_block
from modelship.model.loader import load_model
from modelship.model.registry import CausalLM, UnsupportedModelError, supported_architectures

__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "UnsupportedModelError",
    "allocate_kv_cache",
    "kv_cache_bytes_per_block",
    "load_model",
    "supported_architectures",
]
