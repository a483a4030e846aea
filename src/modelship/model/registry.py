"""Model implementations keyed on `config.json`'s `architectures[0]`."""

from __future__ import annotations

from typing import Protocol

import torch

from modelship.model.attention import AttentionMetadata
from modelship.model.config import ModelConfig
from modelship.model.kv_cache import KVCache
from modelship.model.llama import LinearFactory, LlamaForCausalLM


class CausalLM(Protocol):
    """What the engine needs of a model (see `LlamaForCausalLM`)."""

    config: ModelConfig

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class UnsupportedModelError(ValueError):
    pass


# One implementation covers the family; the differences are config flags (qkv bias, qk norm).
_ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def create_model(
    config: ModelConfig, linear: LinearFactory, max_positions: int, device: torch.device
) -> CausalLM:
    cls = _ARCHITECTURES.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return cls(config, linear, max_positions, device)
