"""Model implementations keyed on `config.json`'s `architectures[0]`."""

from __future__ import annotations

import torch

from modelship.model.base import CausalLM
from modelship.model.config import ModelConfig
from modelship.model.gemma import Gemma2ForCausalLM
from modelship.model.layers import LinearFactory
from modelship.model.llama import LlamaForCausalLM

__all__ = ["CausalLM", "UnsupportedModelError", "create_model", "supported_architectures"]


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture has no implementation here; the message lists ours."""


# One implementation covers the family: the differences are config flags (q/k/v bias,
# per-head or whole-projection q/k norm, q/k/v clipping, explicit head_dim, rope scaling,
# tied embeddings, mixture-of-experts MLPs in some or all layers: `ModelConfig.moe`; Phi-3's
# fused qkv_proj and gate_up_proj tensors are split by the loader).
_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,  # sandwich norms, soft-capping: `gemma.py`
    "Gemma3ForCausalLM": Gemma2ForCausalLM,  # + q/k norm, local RoPE base (text only)
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "OlmoeForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    """The `architectures[0]` values `create_model` accepts, sorted."""
    return sorted(_ARCHITECTURES)


def create_model(
    config: ModelConfig, linear: LinearFactory, max_positions: int, device: torch.device
) -> CausalLM:
    """Build the implementation of `config.architecture`.

    Projections come from `linear` (dense or quantized, already holding their weights);
    every other parameter is left on the meta device for the loader to assign. `device`
    receives the rotary tables for `max_positions` positions.
    """
    cls = _ARCHITECTURES.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return cls(config, linear, max_positions, device)
