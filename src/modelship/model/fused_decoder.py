"""Every decoder layer of a Llama-family model in one C++ call (`csrc/decoder_cpu.cpp`).

On the CPU serving path a layer is four matmuls (W4A8, or dense bf16/fp16/fp32 weights
widened to fp32 in registers: `csrc/dense_cpu.cpp`) and the attention kernel, glued by
~35 small torch ops (norms, residual adds, casts, SiLU * up) that cost as much as the
kernels at batch 1. The fused op runs the glue as loops over rows in C++, with the
residual stream in fp32 from the embedding to the final norm. Rows stay independent of
each other (deterministic greedy decoding, as on the unfused path).

Taken for steps on the CPU attention kernel (`AttentionMetadata.block_table` set) when
every projection is a `W4A8Linear` or a CPU `DenseLinear` and the layers have no q/k norm;
everything else runs `DecoderLayer.forward`. Mixture-of-experts layers are not covered: a
model with any runs all its layers one by one (`LlamaForCausalLM.use_fused_decoder` logs it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from modelship.model.attention import AttentionMetadata
from modelship.model.kv_cache import KVCache
from modelship.model.layers import GatedMLP, RMSNorm
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


def can_fuse(layer: DecoderLayer) -> bool:
    """Whether the fused op computes this layer: a dense gated MLP (not mixture-of-experts),
    W4A8 or dense bf16/fp32 CPU projections (a bias only on q/k/v; dense input widths
    multiples of 8), no q/k norm, no q/k/v clipping."""
    if not isinstance(layer.mlp, GatedMLP):
        return False
    projections = (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    return (
        not layer.qk_norm
        and layer.clip_qkv is None
        and all(_is_fusable_projection(p) for p in projections)
        and all(p.bias is None for p in projections[1:])
    )


def _op_tensors(p: torch.nn.Module) -> list[torch.Tensor]:
    """A projection's three slots in `LayerTensor` order: W4A8 (qweight, scales, mins), dense
    (weight, empty, empty)."""
    if isinstance(p, W4A8Linear):
        return [p.qweight, p.scales, p.mins]
    return [p.weight, torch.empty(0), torch.empty(0)]


class FusedDecoder:
    """The decoder layers' weights gathered once, in the op's order; callable per step.

    Holds references to the projections' packed buffers or dense weights (no copies) and fp32
    copies of the norm weights and q/k/v bias.
    """

    def __init__(self, layers: list[DecoderLayer], final_norm: RMSNorm) -> None:
        if not layers or not all(can_fuse(layer) for layer in layers):
            raise ValueError("every layer must pass can_fuse")
        self.weights: list[torch.Tensor] = []
        for layer in layers:
            qkv, o = layer.qkv_proj, layer.o_proj
            gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
            bias = torch.empty(0) if qkv.bias is None else qkv.bias.float().contiguous()
            self.weights += [  # `LayerTensor` order in decoder_cpu.cpp
                layer.input_layernorm.weight.float().contiguous(),
                *_op_tensors(qkv),
                bias,
                *_op_tensors(o),
                layer.post_attention_layernorm.weight.float().contiguous(),
                *_op_tensors(gate_up),
                *_op_tensors(down),
            ]
        self.final_norm = final_norm.weight.float().contiguous()
        self.eps = final_norm.eps
        self.num_heads = layers[0].num_heads
        self.scale = layers[0].scale

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
            self.eps,
            self.scale,
        )
