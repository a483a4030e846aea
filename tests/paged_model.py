"""One request through a model's paged KV cache, step by step, as the engine's runner
calls it: the harness the architecture parity tests (mixture-of-experts, Phi-3, Gemma)
compare with transformers."""

from __future__ import annotations

import pytest
import torch

from modelship.model import AttentionMetadata, allocate_kv_cache, cpu_kernels

BLOCK = 4  # tokens per cache block: small, so short prompts span scattered blocks
BACKENDS = [
    "sdpa",
    pytest.param(
        "cpu",  # modelship's kernel: RoPE, cache write and attention in one call
        marks=pytest.mark.skipif(not cpu_kernels.load(), reason="needs AVX2 and a compiler"),
    ),
]


def random_ids(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def run(model, steps, block_table, backend):
    """One request step by step through a paged cache: steps = [(token ids, start)]; the
    logits of every step's tokens, concatenated."""
    caches = allocate_kv_cache(model.config, 32, BLOCK, torch.float32, "cpu")
    outputs = []
    for ids, start in steps:
        meta = AttentionMetadata.build(
            [len(ids)], [start + len(ids)], [block_table], BLOCK, "cpu", backend
        )
        positions = torch.arange(start, start + len(ids))
        with torch.no_grad():
            outputs.append(model.compute_logits(model(ids, positions, caches, meta)))
    return torch.cat(outputs)
