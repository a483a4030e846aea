"""`CausalLM`: the interface every model implementation gives the engine."""

from __future__ import annotations

import torch
from torch import nn

from modelship.model.attention import AttentionMetadata
from modelship.model.config import ModelConfig
from modelship.model.kv_cache import KVCache


class CausalLM(nn.Module):
    """A decoder-only language model over a flattened batch and a paged KV cache.

    Implementations are built on the meta device and filled by `loader.load_model`; they
    never allocate the KV cache and never touch request state.
    """

    config: ModelConfig

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of activations (and of dense weights)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64: the step's requests, one after another
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[KVCache],  # one per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] in the compute dtype
        """Run the step's tokens; writes their K/V into `kv_caches` at the slot mapping."""
        raise NotImplementedError

    def use_int8_head(self) -> bool:
        """Switch logits to an int8 copy of the output head; False: not possible here."""
        return False

    def use_int4_head(self) -> bool:
        """Switch logits (and tied embeddings) to a 4-bit copy of the output head; False:
        not possible here."""
        return False

    def use_fused_decoder(self) -> bool:
        """Run the decoder layers in one fused CPU call where possible; False: not here."""
        return False

    def graph_capture_error(self) -> str | None:
        """Why this model's forward cannot be recorded as a CUDA graph; None if it can."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32. Does not modify anything."""
        raise NotImplementedError
