"""Gemma 2 (Gemma2ForCausalLM) and Gemma 3 text (Gemma3ForCausalLM) on the Llama
decoder's skeleton.

What differs from Llama: the embeddings are scaled by sqrt(hidden_size); every RMSNorm
multiplies by (1 + weight) (folded into the weight once at load); attention and MLP each
have a norm before and after (the sub-block's output is normalized before it joins the
residual stream); the MLP is GeGLU (tanh-approximated GELU); the attention scale is
query_pre_attn_scalar^-0.5; attention scores and the final logits are soft-capped,
cap * tanh(x / cap). Gemma 3 adds a per-head (1 + weight) RMSNorm of q and k before RoPE,
drops the soft-caps, and rotates its sliding layers with their own base
(`local_rope_theta`, unscaled) and its global ones with `rope_theta` and its scaling.

Soft-capping sits between q k^T and the softmax, which neither the CPU kernel nor the
Triton kernel nor SDPA can do, so Gemma 2's attention runs in PyTorch ("eager"): the
K/V are written to the paged cache as everywhere, then each request's context is read
through whichever metadata the step was built for, one request at a time (a log line
says so at load). Gemma 3 has no soft-cap: its attention runs in the step's backend. The
fused CPU decoder is declined for both (sandwich norms).

Sliding-window layers (`layer_types`, else every other one from the first) let a query see
only the last `sliding_window` positions up to its own, in the kernels as in the PyTorch
attention. The global layers read every position, so the KV blocks that fall out of the
windows are kept, not freed (`ModelConfig.kv_window` is None).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modelship.model.attention import AttentionMetadata, paged_attention
from modelship.model.config import ModelConfig, ModelConfigError
from modelship.model.kv_cache import KVCache
from modelship.model.layers import GatedMLP, LinearFactory, RMSNorm, RotaryEmbedding, apply_rope_
from modelship.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight): the checkpoint stores the offset from 1."""

    def finish_loading(self) -> None:
        self.weight.add_(1.0)
        super().finish_loading()


class GeGLU(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))


class Gemma2DecoderLayer(nn.Module):
    """Sandwich-normed attention and GeGLU MLP; the residual stream is passed along."""

    def __init__(self, config: ModelConfig, index: int, prefix: str, linear: LinearFactory) -> None:
        super().__init__()
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim, self.q_size = config.head_dim, config.q_size
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.window = config.layer_window(index)
        self.qkv_proj = linear(
            [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], config.qkv_bias
        )
        self.o_proj = linear([f"{attn}.o_proj"], False)
        self.mlp = GeGLU(
            linear([f"{mlp}.gate_proj", f"{mlp}.up_proj"], False),
            linear([f"{mlp}.down_proj"], False),
            config.intermediate_size,
        )
        with torch.device("meta"):  # assigned from the checkpoint by the loader
            size, eps = config.hidden_size, config.rms_norm_eps
            self.input_layernorm = GemmaRMSNorm(size, eps)
            self.post_attention_layernorm = GemmaRMSNorm(size, eps)
            self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
            self.qk_norm = config.qk_norm
            if config.qk_norm:  # Gemma 3: per head
                self.q_norm = GemmaRMSNorm(config.head_dim, eps)
                self.k_norm = GemmaRMSNorm(config.head_dim, eps)
        # Gemma 3's sliding layers read the local rotary tables
        self.local_rope = self.window is not None and config.local_rope_theta is not None

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output
        residual: torch.Tensor | None,  # None in the first layer
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]; the CPU backend: the whole table
        sin: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden if residual is None else hidden.add_(residual)
        qkv = self.qkv_proj(self.input_layernorm(residual))
        n = qkv.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qk_norm:
            q_end, k_end = self.q_size, self.q_size + kv_heads * dim
            q, k = qkv[:, :q_end].view(n, heads, dim), qkv[:, q_end:k_end].view(n, kv_heads, dim)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if meta.backend == "cpu":  # the kernels' metadata carries whole tables
            assert meta.token_position is not None
            positions = meta.token_position.long()
            cos = cos.index_select(0, positions).unsqueeze(1).to(qkv.dtype)
            sin = sin.index_select(0, positions).unsqueeze(1).to(qkv.dtype)
        apply_rope_(qkv[:, : self.q_size + kv_heads * dim].view(n, heads + kv_heads, dim), cos, sin)
        q = qkv[:, : self.q_size].view(n, heads, dim)
        kv = qkv[:, self.q_size :].view(n, 2, kv_heads, dim)
        if self.softcap is None:  # Gemma 3: the step's kernel
            attn = paged_attention(q, kv, cache, meta, self.scale, self.window)
        else:
            attn = softcapped_attention(q, kv, cache, meta, self.scale, self.softcap, self.window)
        attn = self.post_attention_layernorm(self.o_proj(attn.reshape(n, self.q_size)))
        residual = attn.add_(residual)
        out = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(out), residual


@dataclass
class _RequestSpan:
    """One request's part of a step."""

    rows: slice  # its query tokens' rows in the batch
    slots: torch.Tensor  # [context length] its context's cache slots, in position order
    positions: torch.Tensor  # [rows] its query tokens' positions


def _requests(meta: AttentionMetadata) -> list[_RequestSpan]:
    """The step's requests, from either kind of metadata (the kernels' or SDPA's)."""
    out = []
    if meta.backend in ("cpu", "triton"):
        assert meta.token_request is not None and meta.token_position is not None
        assert meta.block_table is not None
        requests, counts = torch.unique_consecutive(meta.token_request, return_counts=True)
        start = 0
        block = torch.arange(meta.block_size, device=meta.block_table.device)
        for request, count in zip(requests.tolist(), counts.tolist(), strict=True):
            rows = slice(start, start + count)
            positions = meta.token_position[rows].long()
            length = int(positions[-1]) + 1
            table = meta.block_table[request].long()
            slots = (table.unsqueeze(1) * meta.block_size + block).flatten()[:length]
            out.append(_RequestSpan(rows, slots, positions))
            start += count
        return out
    if meta.num_decode:
        assert meta.decode_slots is not None
        rows = meta.decode_rows
        if meta.decode_mask is None:
            lengths = [meta.decode_slots.shape[1]] * meta.num_decode
        else:
            lengths = meta.decode_mask.flatten(1).sum(1).tolist()
        for i, length in enumerate(lengths):
            row = i if rows is None else int(rows[i])
            position = torch.tensor([length - 1], device=meta.decode_slots.device)
            out.append(_RequestSpan(slice(row, row + 1), meta.decode_slots[i, :length], position))
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        slots = meta.slot_mapping[rows] if chunk.context_slots is None else chunk.context_slots
        length = slots.shape[0]
        positions = torch.arange(length - chunk.num_tokens, length, device=slots.device)
        out.append(_RequestSpan(rows, slots, positions))
    return out


def softcapped_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim], rotated
    kv: torch.Tensor,  # [num_tokens, 2, kv_heads, head_dim], k rotated
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None,
    window: int | None = None,
) -> torch.Tensor:  # [num_tokens, heads, head_dim] in q's dtype
    """Write the step's K/V, then causal attention with scores cap * tanh(s / cap) before
    the softmax (fp32), each request over its context as the cache holds it; with `window`,
    a query at position p sees positions p - window + 1 .. p only."""
    cache.write(meta.slot_mapping, kv.to(cache.dtype))
    out = torch.empty_like(q)
    group = q.shape[1] // kv.shape[2]
    for span in _requests(meta):
        rows, slots, positions = span.rows, span.slots, span.positions
        context = cache.read(slots).float()  # [length, 2, kv_heads, head_dim]
        keys = context[:, 0].repeat_interleave(group, dim=1)  # [length, heads, head_dim]
        values = context[:, 1].repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[rows].float(), keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        keys_at = torch.arange(slots.shape[0], device=scores.device)
        visible = keys_at <= positions.unsqueeze(1)  # [queries, keys]
        if window is not None:
            visible &= keys_at > positions.unsqueeze(1) - window
        scores.masked_fill_(~visible, float("-inf"))
        weights = scores.softmax(dim=-1)
        out[rows] = torch.einsum("hts,shd->thd", weights, values).to(q.dtype)
    return out


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: `LlamaForCausalLM` with Gemma's layers, norm, embedding scale and capped
    logits; tied embeddings as the checkpoints have them."""

    layer_class = Gemma2DecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(
        self, config: ModelConfig, linear: LinearFactory, max_positions: int, device: torch.device
    ) -> None:
        if config.hidden_act not in _ACTIVATIONS:
            raise ModelConfigError(
                f"{config.architecture}: hidden_activation {config.hidden_act!r} is not "
                f"supported; supported: {', '.join(_ACTIVATIONS)}"
            )
        super().__init__(config, linear, max_positions, device)
        self.rotaries = [self.rotary]
        if config.local_rope_theta is not None:
            local = dataclasses.replace(
                config, rope_theta=config.local_rope_theta, rope_scaling=None
            )
            self.local_rotary = RotaryEmbedding(local, max_positions, device)
            self.rotaries.append(self.local_rotary)
        if config.attn_logit_softcapping is not None:
            logger.info(
                "%s: attention soft-capping (attn_logit_softcapping %s) is not in the CPU, "
                "Triton or SDPA kernels: attention runs in PyTorch ops",
                config.architecture,
                config.attn_logit_softcapping,
            )

    def enable_lora(self):
        raise ValueError(f"LoRA adapters on {self.config.architecture} are not supported")

    def use_fused_decoder(self) -> bool:
        logger.info(
            "%s: the fused CPU decoder has no sandwich norms or soft-capping: layers run one "
            "by one",
            self.config.architecture,
        )
        return False

    def graph_capture_error(self) -> str | None:
        if self.config.attn_logit_softcapping is None:
            return None
        # `_requests` reads the step's request boundaries back to the host every layer
        return (
            f"{self.config.architecture}'s soft-capped attention walks the step's requests "
            "on the host, which a CUDA graph cannot record"
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """As `LlamaForCausalLM.forward`, with the rotary tables each layer asks for."""
        hidden = self.embed(input_ids)
        if attn_metadata.backend == "cpu":  # whole fp32 tables, indexed in the layer
            tables = [(rotary.cos, rotary.sin) for rotary in self.rotaries]
        else:
            tables = [rotary.tables(positions, hidden.dtype) for rotary in self.rotaries]
        residual = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = tables[int(layer.local_rope)]
            hidden, residual = layer(hidden, residual, cos, sin, cache, attn_metadata)
        return self.norm(hidden.add_(residual))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        # the factor rounded to the compute dtype first, as transformers does
        return hidden.mul_(torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return logits.div_(cap).tanh_().mul_(cap)
