"""A model with SmolLM2-135M's layer shapes (hidden 576, 9 heads / 3 KV heads of 64, MLP
1536) and random weights of the caller's kind, built without a checkpoint; and one run of it,
step by step, through a paged cache. The fused decoder's tests (int4 in
test_fused_decoder.py, dense in test_dense_cpu.py) compare its fused and per-layer paths."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from modelship.model import AttentionMetadata, allocate_kv_cache
from modelship.model.config import ModelConfig
from modelship.model.layers import RMSNorm
from modelship.model.llama import LlamaForCausalLM

BLOCK = 16
VOCAB = 512
WIDTHS = {  # output width, input width of each checkpoint projection
    "q_proj": (576, 576),
    "k_proj": (192, 576),
    "v_proj": (192, 576),
    "o_proj": (576, 576),
    "gate_proj": (1536, 576),
    "up_proj": (1536, 576),
    "down_proj": (576, 1536),
}
# (out_features, in_features, generator, with a bias, dtype) -> the projection
MakeLinear = Callable[[int, int, torch.Generator, bool, torch.dtype], nn.Module]


def demo_shaped_model(
    make_linear: MakeLinear,
    num_layers: int = 2,
    qkv_bias: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> LlamaForCausalLM:
    """Projections from `make_linear`; embeddings and (randomized) norms in `dtype`."""
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=576,
        intermediate_size=1536,
        num_layers=num_layers,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        qkv_bias=qkv_bias,
        qk_norm=False,
        checkpoint_dtype=dtype,
        eos_token_ids=(0,),
        quantization_config=None,
    )
    gen = torch.Generator().manual_seed(seed)

    def linear(prefixes: list[str], bias: bool) -> nn.Module:
        out_features = sum(WIDTHS[p.rsplit(".", 1)[1]][0] for p in prefixes)
        in_features = WIDTHS[prefixes[0].rsplit(".", 1)[1]][1]
        return make_linear(out_features, in_features, gen, bias, dtype)

    model = LlamaForCausalLM(config, linear, max_positions=256, device=torch.device("cpu"))
    embed = torch.randn(VOCAB, 576, generator=gen).to(dtype)
    model.embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            weight = 1 + 0.2 * torch.randn(module.size, generator=gen)
            module.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
            module.finish_loading()
    return model


def run(model, steps, fused: bool, num_blocks: int = 32) -> tuple[list[torch.Tensor], list]:
    """steps[s] = [(block table, token ids, start position)]: each step's final hidden
    states [num_tokens, hidden], and the KV caches afterwards."""
    if fused:
        assert model.use_fused_decoder()
    else:
        model.fused_decoder = None
    caches = allocate_kv_cache(model.config, num_blocks, BLOCK, torch.float32, "cpu")
    outputs = []
    for step in steps:
        ids = torch.cat([s[1] for s in step])
        positions = torch.cat([torch.arange(s[2], s[2] + len(s[1])) for s in step])
        meta = AttentionMetadata.build(
            [len(s[1]) for s in step],
            [s[2] + len(s[1]) for s in step],
            [s[0] for s in step],
            BLOCK,
            "cpu",
            "cpu",
        )
        with torch.inference_mode():
            outputs.append(model(ids, positions, caches, meta))
    return outputs, caches


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


A, B, C = ids(40, 1), ids(23, 2), ids(5, 3)
TABLE_A, TABLE_B, TABLE_C = [3, 0, 7], [1, 4], [9]
# prefill, then a mixed step (a decode, a whole prompt, a prefill chunk), then decodes
MIXED_STEPS = [
    [(TABLE_A, A[:30], 0)],
    [(TABLE_A, A[30:31], 30), (TABLE_C, C, 0), (TABLE_B, B[:17], 0)],
    [(TABLE_B, B[17:23], 17), (TABLE_A, A[31:32], 31), (TABLE_C, C[:1] + 1, 5)],
    [(TABLE_A, A[32:33], 32), (TABLE_B, B[:1], 23)],
]


def request_a_alone_and_chunked(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Request A's 33 rows through the fused path in one step alone, and again in 7-token
    chunks next to other requests, then a decode: (alone, chunked), row for row."""
    alone, _ = run(model, [[(TABLE_A, A[:33], 0)]], fused=True)
    chunked, _ = run(
        model,
        [
            [(TABLE_A, A[:7], 0), (TABLE_B, B[:9], 0)],
            [(TABLE_C, C, 0), (TABLE_A, A[7:14], 7)],
            [(TABLE_A, A[14:21], 14)],
            [(TABLE_B, B[9:10], 9), (TABLE_A, A[21:28], 21)],
            [(TABLE_A, A[28:32], 28), (TABLE_C, C[:1], 5)],
            [(TABLE_A, A[32:33], 32)],
        ],
        fused=True,
    )
    rows = torch.cat([chunked[0][:7], chunked[1][5:], chunked[2], chunked[3][1:]])
    return alone[0], torch.cat([rows, chunked[4][:4], chunked[5]])
