"""Every decoder layer of a Llama-family model in one C++ call (`csrc/decoder_cpu.cpp`).

On the CPU serving path a layer is four matmuls (W4A8, or dense bf16/fp16/fp32 weights
widened to fp32 in registers: `csrc/dense_cpu.cpp`) and the attention kernel, glued by
~35 small torch ops (norms, residual adds, casts, SiLU * up) that cost as much as the
kernels at batch 1. The fused op runs the glue as loops over rows in C++, with the
residual stream in fp32 from the embedding to the final norm. Rows stay independent of
each other (deterministic greedy decoding, as on the unfused path).

Mixture-of-experts layers run in the op too (`csrc/moe_cpu.cpp`): the router in fp32, the
top-k with the family's renormalization, each active expert once on its group of rows, and
each token's weighted expert outputs summed in ascending expert order, so a row's result
does not depend on the batch either; Qwen2-MoE's sigmoid-gated shared expert is added
after them. The experts stay the per-expert modules the loader built; the op reads their
tensors where they lie (no stacked copy, which would hold every expert twice or need the
modules rebuilt as views of it).

Taken for steps on the CPU attention kernel (`AttentionMetadata.block_table` set) when
every projection is a `W4A8Linear` or a CPU `DenseLinear` (`can_fuse`); q/k RMSNorm (whole
projection as OLMoE, per head as Qwen3) and q/k/v clipping are in the op. Everything else
runs `DecoderLayer.forward`: sliding windows, an expert-parallel rank's share of the
experts, fp16 activations, LoRA steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from modelship.model.attention import AttentionMetadata
from modelship.model.kv_cache import KVCache
from modelship.model.layers import GatedMLP, RMSNorm
from modelship.model.moe import MoEMLP
from modelship.model.quant.base import DenseLinear
from modelship.model.quant.int4 import W4A8Linear

if TYPE_CHECKING:
    from modelship.model.llama import DecoderLayer


# Dense weights the op reads; the model's activations (its dtype) must be bf16 or fp32 too.
_DENSE_DTYPES = (torch.bfloat16, torch.float32)


def _is_fusable_projection(p: torch.nn.Module) -> bool:
    if isinstance(p, W4A8Linear):
        return True
    return (
        isinstance(p, DenseLinear)
        and p.weight.device.type == "cpu"
        and p.weight.dtype in _DENSE_DTYPES
        and p.weight.is_contiguous()
        and p.weight.shape[1] % 8 == 0  # the op's norm and SiLU loops: 8 columns at a time
    )


def _mlps(mlp: torch.nn.Module) -> list[GatedMLP] | None:
    """The gated MLPs the op runs for a layer: its MLP, or a routed layer's experts and
    shared expert; None where the op has no such MLP (an expert-parallel rank's share)."""
    if isinstance(mlp, GatedMLP):
        return [mlp]
    if isinstance(mlp, MoEMLP) and mlp.local_experts == (0, mlp.num_experts):
        return [*mlp.experts, *([mlp.shared_expert] if mlp.shared_expert is not None else [])]
    return None


def can_fuse(layer: DecoderLayer) -> bool:
    """Whether the fused op computes this layer: a dense gated MLP or a mixture of experts
    holding all its experts (not an expert-parallel share), W4A8 or dense bf16/fp32 CPU
    projections (a bias only on q/k/v; dense input widths multiples of 8), q/k norm widths
    multiples of 8."""
    mlps = _mlps(layer.mlp)
    if mlps is None:
        return False
    projections = [layer.qkv_proj, layer.o_proj]
    projections += [p for mlp in mlps for p in (mlp.gate_up_proj, mlp.down_proj)]
    return (
        (not layer.qk_norm or (layer.q_norm.size % 8 == 0 and layer.k_norm.size % 8 == 0))
        and all(_is_fusable_projection(p) for p in projections)
        and all(p.bias is None for p in projections[1:])
    )


def _op_tensors(p: torch.nn.Module) -> list[torch.Tensor]:
    """A projection's three slots in `LayerTensor` order: W4A8 (qweight, scales, mins), dense
    (weight, empty, empty)."""
    if isinstance(p, W4A8Linear):
        return [p.qweight, p.scales, p.mins]
    return [p.weight, torch.empty(0), torch.empty(0)]


def _mlp_tensors(mlp: GatedMLP | None) -> list[torch.Tensor]:
    """gate_up's three slots, then down's; six empty tensors for no MLP."""
    if mlp is None:
        return [torch.empty(0)] * 6
    return [*_op_tensors(mlp.gate_up_proj), *_op_tensors(mlp.down_proj)]


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


class FusedDecoder:
    """The decoder layers' weights gathered once, in the op's order; callable per step.

    Holds references to the projections' packed buffers or dense weights, the experts' among
    them (no copies: each expert keeps its own tensors, which the op reads where they lie,
    so a model holds its experts once), and fp32 copies of the norm weights, the q/k/v bias,
    the routers and the shared-expert gates.
    """

    def __init__(self, layers: list[DecoderLayer], final_norm: RMSNorm) -> None:
        if not layers or not all(can_fuse(layer) for layer in layers):
            raise ValueError("every layer must pass can_fuse")
        self.weights: list[torch.Tensor] = []
        self.experts: list[torch.Tensor] = []  # the routed layers', layer by layer
        self.top_k, self.normalize_top_k = 0, False
        empty = torch.empty(0)
        for layer in layers:
            qkv, o, mlp = layer.qkv_proj, layer.o_proj, layer.mlp
            routed = isinstance(mlp, MoEMLP)
            qk_norm = (
                [_fp32(layer.q_norm.weight), _fp32(layer.k_norm.weight)]
                if layer.qk_norm
                else [empty, empty]
            )
            self.weights += [  # `LayerTensor` order in decoder_cpu.cpp
                _fp32(layer.input_layernorm.weight),
                *_op_tensors(qkv),
                empty if qkv.bias is None else _fp32(qkv.bias),
                *qk_norm,
                *_op_tensors(o),
                _fp32(layer.post_attention_layernorm.weight),
                *_mlp_tensors(mlp.shared_expert if routed else mlp),
                _fp32(mlp.gate.weight) if routed else empty,
                _fp32(mlp.shared_expert_gate.weight)
                if routed and mlp.shared_expert is not None
                else empty,
            ]
            if routed:
                self.top_k, self.normalize_top_k = mlp.top_k, mlp.gate.normalize
                for expert in mlp.experts:
                    self.experts += _mlp_tensors(expert)
        self.final_norm = _fp32(final_norm.weight)
        self.eps = final_norm.eps
        self.num_heads = layers[0].num_heads
        self.scale = layers[0].scale
        self.clip_qkv = layers[0].clip_qkv or 0.0  # 0: none

    def __call__(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the step's embeddings
        kv_caches: list[KVCache],  # fp32 or int8, one per layer: this step's K/V land here
        cos: torch.Tensor,  # [max_positions, head_dim] fp32
        sin: torch.Tensor,  # [max_positions, head_dim] fp32, rotate-half sign folded in
        meta: AttentionMetadata,  # built for the "cpu" backend
    ) -> torch.Tensor:  # [num_tokens, hidden] in hidden's dtype, after the final norm
        return torch.ops.modelship.decoder_layers(
            hidden.contiguous(),
            self.weights,
            self.experts,
            self.final_norm,
            [cache.kv for cache in kv_caches],
            [cache.scales for cache in kv_caches if cache.scales is not None],
            cos,
            sin,
            meta.slot_mapping,
            meta.block_table,
            meta.token_request,
            meta.token_position,
            meta.block_size,
            self.num_heads,
            self.top_k,
            self.normalize_top_k,
            self.eps,
            self.scale,
            self.clip_qkv,
        )
