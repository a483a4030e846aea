"""The Llama-family decoder: Llama 2/3 (incl. llama3 RoPE scaling), Mistral, SmolLM,
TinyLlama, Qwen2/2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm); GQA, tied embeddings.

Tokens of all scheduled sequences are flattened into one batch ([num_tokens, hidden]); the
only per-sequence work is attention, which reads the paged KV cache (`attention.py`).
q/k/v and gate/up are fused into one projection each at load time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from modelship.model.attention import AttentionMetadata, paged_attention
from modelship.model.config import ModelConfig
from modelship.model.kv_cache import KVCache
from modelship.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope

# (checkpoint prefixes of projections sharing an input, has bias) -> fused linear module
LinearFactory = Callable[[list[str], bool], nn.Module]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, linear: LinearFactory) -> None:
        super().__init__()
        attn = f"{prefix}.self_attn"
        mlp = f"{prefix}.mlp"
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = linear([f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"],
                               config.qkv_bias)  # fmt: skip
        self.o_proj = linear([f"{attn}.o_proj"], False)
        self.mlp = GatedMLP(
            linear([f"{mlp}.gate_proj", f"{mlp}.up_proj"], False),
            linear([f"{mlp}.down_proj"], False),
            config.intermediate_size,
        )
        with torch.device("meta"):
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            if config.qk_norm:
                self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
                self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden if residual is None else hidden + residual
        x = self.input_layernorm(residual)
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        attn = paged_attention(q, k, v, cache, meta, self.scale)
        hidden = self.o_proj(attn.reshape(num_tokens, self.q_size))
        residual = hidden + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


class LlamaForCausalLM(nn.Module):
    """Projections come from `linear` (dense or quantized); embeddings and norms are built
    on the meta device and assigned from the checkpoint by the loader."""

    def __init__(
        self,
        config: ModelConfig,
        linear: LinearFactory,
        max_positions: int,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(config, f"model.layers.{i}", linear) for i in range(config.num_layers)
        )
        self.lm_head = None if config.tie_word_embeddings else linear(["lm_head"], False)
        self.rotary = RotaryEmbedding(config, max_positions, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(positions, hidden.dtype)
        residual = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, cache, attn_metadata)
        return self.norm(hidden + residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32."""
        if self.lm_head is None:
            return (hidden @ self.embed_tokens.weight.t()).float()
        return self.lm_head(hidden).float()
