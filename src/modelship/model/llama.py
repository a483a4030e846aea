"""The Llama-family decoder: Llama 2/3 (incl. llama3 RoPE scaling), Mistral, SmolLM,
TinyLlama, Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k RMSNorm, explicit head_dim) and
Phi-3/Phi-4 (fused checkpoint tensors split by the loader, LongRoPE in `layers.py`); GQA,
tied embeddings. With `moe.py`'s routed MLP in some or all layers: Mixtral, OLMoE
(q/k RMSNorm over the whole projection, optional q/k/v clipping), Qwen2-MoE (shared
expert) and Qwen3-MoE.

Tokens of all scheduled requests are flattened into one batch ([num_tokens, hidden]); the
only per-request work is attention, which reads the paged KV cache (`attention.py`).
q/k/v and gate/up are fused into one projection each at load time, so a layer runs four
matmuls. On CPU-kernel steps with W4A8 or dense CPU projections all layers, routed ones
included, run in one C++ call (`fused_decoder.py`); `DecoderLayer.forward` is the path for
everything else.
Sliding windows (`sliding_window` in config.json: Mistral v0.1 and Phi-3 in every layer,
Qwen2/3 past `max_window_layers`) go to every attention backend; the fused decoder has
none, so a windowed model runs layer by layer.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from modelship.model import cpu_kernels
from modelship.model.attention import AttentionMetadata, paged_attention
from modelship.model.base import CausalLM
from modelship.model.config import ModelConfig
from modelship.model.fused_decoder import FusedDecoder, can_fuse
from modelship.model.kv_cache import KVCache
from modelship.model.layers import (
    GatedMLP,
    LinearFactory,
    RMSNorm,
    RotaryEmbedding,
    apply_rope_,
)
from modelship.model.lora import LoRAContext, attach_lora
from modelship.model.moe import MoEMLP, moe_block
from modelship.model.quant.base import DenseLinear, bf16_upcast_rows, dense_linear
from modelship.model.quant.int4_head import Int4Head, int4_head_supports
from modelship.model.quant.int8 import W8A8Linear, int8_head_supports

logger = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    """Pre-norm attention + gated MLP; the residual stream is passed along, not re-added."""

    def __init__(self, config: ModelConfig, index: int, prefix: str, linear: LinearFactory) -> None:
        super().__init__()
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        self.window = config.layer_window(index)  # None: attends to every position
        self.qk_norm = config.qk_norm
        self.qk_norm_per_head = config.qk_norm_scope == "head"
        self.clip_qkv = config.clip_qkv
        self.qkv_proj = linear(
            [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], config.qkv_bias
        )
        self.o_proj = linear([f"{attn}.o_proj"], False)
        self.mlp: GatedMLP | MoEMLP
        if config.moe is not None and index in config.moe.sparse_layers:
            self.mlp = MoEMLP(config, f"{prefix}.{moe_block(config.architecture)}", linear)
        else:
            self.mlp = GatedMLP(
                linear([f"{mlp}.gate_proj", f"{mlp}.up_proj"], False),
                linear([f"{mlp}.down_proj"], False),
                config.intermediate_size,
            )
        with torch.device("meta"):  # assigned from the checkpoint by the loader
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            if config.qk_norm:  # per head, or over the whole q and k projections
                q_width, k_width = (
                    (config.head_dim, config.head_dim)
                    if self.qk_norm_per_head
                    else (config.q_size, config.kv_size)
                )
                self.q_norm = RMSNorm(q_width, config.rms_norm_eps)
                self.k_norm = RMSNorm(k_width, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None in the first layer
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]; the CPU kernel: [max_positions, head_dim]
        sin: torch.Tensor,  # (same)
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream)
        # `hidden` is a fresh tensor this model made, so adding in place is safe.
        residual = hidden if residual is None else hidden.add_(residual)
        qkv = self.qkv_proj(self.input_layernorm(residual))  # [num_tokens, q + 2 * kv], fresh
        num_tokens = qkv.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, qk_size = self.q_size, self.q_size + self.kv_size
        if self.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE; OLMoE: whole
            q, k = qkv[:, :q_size], qkv[:, q_size:qk_size]
            if self.qk_norm_per_head:
                q = q.view(num_tokens, heads, head_dim)
                k = k.view(num_tokens, kv_heads, head_dim)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        if meta.backend == "cpu":  # one kernel call: RoPE, cache write and attention
            # cos/sin are the whole tables here, indexed by position inside the kernel
            attn = cpu_kernels.rope_paged_attention(
                qkv, cache, cos, sin, meta, self.scale, heads, self.window
            )  # [num_tokens, q_size]
            residual = self.o_proj(attn).add_(residual)
            return self.mlp(self.post_attention_layernorm(residual)), residual
        # Triton and SDPA: q and k heads rotated together, in place: qkv then holds
        # q | rotated k | v, and the k | v part is exactly one cache slot's layout per token.
        apply_rope_(qkv[:, :qk_size].view(num_tokens, heads + kv_heads, head_dim), cos, sin)
        q = qkv[:, :q_size].view(num_tokens, heads, head_dim)
        kv = qkv[:, q_size:].view(num_tokens, 2, kv_heads, head_dim)
        attn = paged_attention(q, kv, cache, meta, self.scale, self.window)
        residual = self.o_proj(attn.reshape(num_tokens, q_size)).add_(residual)
        return self.mlp(self.post_attention_layernorm(residual)), residual


class LlamaForCausalLM(CausalLM):
    """Projections come from `linear` (dense or quantized, weights included); embeddings and
    norms are built on the meta device and assigned from the checkpoint by the loader.
    A variant family (`gemma.py`) swaps the layer and norm classes."""

    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[RMSNorm] = RMSNorm

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
            # `_weight` skips the random init: on the meta device it would import
            # torch._dynamo (2.2 s of a replica's cold start) to initialize nothing.
            self.embed_tokens = nn.Embedding(
                config.vocab_size,
                config.hidden_size,
                _weight=torch.empty(config.vocab_size, config.hidden_size),
            )
            self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            self.layer_class(config, i, f"model.layers.{i}", linear)
            for i in range(config.num_layers)
        )
        self.lm_head = None if config.tie_word_embeddings else linear(["lm_head"], False)
        self.rotary = RotaryEmbedding(config, max_positions, device)
        # a quantized copy of the output head computing the logits: `W8A8Linear` (set by
        # `use_int8_head`) or `Int4Head` (`use_int4_head`: it replaces the 16-bit matrix,
        # and with tied embeddings `int4_embedding` serves the lookups from it)
        self.quantized_head: nn.Module | None = None
        self.int4_embedding: Int4Head | None = None
        self.fused_decoder: FusedDecoder | None = None  # set by `use_fused_decoder`
        self.lora: LoRAContext | None = None  # set by `enable_lora`

    def enable_lora(self) -> LoRAContext:
        """Hook the projections for LoRA deltas (`lora.py`); the runner fills the returned
        context per step. Steps with adapter rows skip the fused decoder (it calls no hooks)."""
        if self.config.moe is not None:
            raise ValueError(
                f"LoRA adapters on mixture-of-experts models ({self.config.architecture}) "
                "are not supported"
            )
        if self.lora is None:
            c = self.config
            self.lora = attach_lora(
                self.layers,
                {
                    "qkv_proj": [c.q_size, c.kv_size, c.kv_size],
                    "o_proj": [c.hidden_size],
                    "mlp.gate_up_proj": [c.intermediate_size, c.intermediate_size],
                    "mlp.down_proj": [c.hidden_size],
                },
            )
        return self.lora

    def use_int8_head(self) -> bool:
        """Compute logits with an int8 copy of the (dense) output head; False where the
        head is already quantized or its width does not fit the kernel."""
        head = self.lm_head
        if head is not None and not isinstance(head, DenseLinear):
            return False
        weight = self.embed_tokens.weight if head is None else head.weight
        if not int8_head_supports(weight.shape[1]) or (head is not None and head.bias is not None):
            return False
        self.quantized_head = W8A8Linear.from_dense(weight)
        return True

    def use_int4_head(self) -> bool:
        """Compute logits with a 4-bit copy of the (dense) output head (`quant.int4_head`),
        which replaces the 16-bit one (freed); with tied embeddings the lookups read the same
        4-bit rows. False where the head is already quantized, has a bias, or its width does
        not fit the kernel."""
        head = self.lm_head
        if head is not None and (not isinstance(head, DenseLinear) or head.bias is not None):
            return False
        weight = self.embed_tokens.weight if head is None else head.weight
        if not int4_head_supports(*weight.shape):
            return False
        quantized = Int4Head.from_dense(weight)
        self.quantized_head = quantized
        # the 4-bit copy replaces the 16-bit matrix; an empty one keeps its dtype (`dtype`)
        empty = nn.Parameter(weight.new_empty(0, weight.shape[1]), requires_grad=False)
        if head is None:  # tied: the lookups read the same 4-bit rows
            self.int4_embedding = quantized
            self.embed_tokens.weight = empty
        else:
            head.weight = empty
        return True

    def use_fused_decoder(self) -> bool:
        """Run all layers in one C++ call on CPU-kernel steps; False where some layer is not
        fusable (see `fused_decoder.can_fuse`). The fallback is per model: the fused op
        runs every layer or none."""
        if any(layer.window is not None for layer in self.layers):
            logger.info(
                "%s: the fused CPU decoder has no sliding window (sliding_window %d): "
                "layers run one by one",
                self.config.architecture,
                self.config.sliding_window,
            )
            return False
        unfused = [i for i, layer in enumerate(self.layers) if not can_fuse(layer)]
        if unfused:
            logger.info(
                "%s: layers %s are outside the fused CPU decoder (`fused_decoder.can_fuse`): "
                "all layers run one by one",
                self.config.architecture,
                unfused,
            )
            return False
        self.fused_decoder = FusedDecoder(list(self.layers), self.norm)
        return True

    def graph_capture_error(self) -> str | None:
        if self.config.moe is None:
            return None
        # `MoEMLP.forward` reads the experts' group sizes back to the host each layer
        return (
            f"{self.config.architecture} routes tokens to experts with host-side group "
            "sizes, which a CUDA graph cannot record"
        )

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
        hidden = self.embed(input_ids)
        if attn_metadata.backend == "cpu":  # the CPU kernel indexes the fp32 tables
            cos, sin = self.rotary.cos, self.rotary.sin
            if self.fused_decoder is not None and not (self.lora and self.lora.segments):
                return self.fused_decoder(hidden, kv_caches, cos, sin, attn_metadata)
        else:
            cos, sin = self.rotary.tables(positions, hidden.dtype)
        residual = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, cache, attn_metadata)
        return self.norm(hidden.add_(residual))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden], fresh
        if self.int4_embedding is not None:
            return self.int4_embedding.embed(input_ids).to(self.dtype)
        return F.embedding(input_ids, self.embed_tokens.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32."""
        if self.quantized_head is not None:
            return self.quantized_head(hidden)
        head = self.lm_head
        if head is None or isinstance(head, DenseLinear):
            weight = self.embed_tokens.weight if head is None else head.weight
            bias = None if head is None else head.bias
            upcast = bf16_upcast_rows(weight.device, weight.dtype)
            return dense_linear(hidden, weight, bias, upcast, out_dtype=torch.float32)
        return head(hidden).float()
