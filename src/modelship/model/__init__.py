"""modelship.model: our PyTorch implementations of the Llama family, loading safetensors."""

from modelship.model.attention import AttentionMetadata
from modelship.model.base import CausalLM
from modelship.model.config import ModelConfig, ModelConfigError
from modelship.model.kv_cache import KVCache, allocate_kv_cache, kv_cache_bytes_per_block
from modelship.model.loader import MissingWeightError, load_model
from modelship.model.quant import UnsupportedQuantizationError
from modelship.model.registry import UnsupportedModelError, create_model, supported_architectures

__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "KVCache",
    "MissingWeightError",
    "ModelConfig",
    "ModelConfigError",
    "UnsupportedModelError",
    "UnsupportedQuantizationError",
    "allocate_kv_cache",
    "create_model",
    "kv_cache_bytes_per_block",
    "load_model",
    "supported_architectures",
]
