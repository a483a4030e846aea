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


def engine_prefill_logits(engine, prompts: list[list[int]]) -> torch.Tensor:
    """Every position's logits of `prompts` as one prefill batch through an engine's model
    and KV cache (blocks from 0 on: scratch), the way tensor- and expert-parallel tests
    compare one rank with several."""
    block = engine.config.block_size
    tables, lens, next_block = [], [len(p) for p in prompts], 0
    for length in lens:
        count = -(-length // block)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    meta = AttentionMetadata.build(lens, lens, tables, block, torch.device("cpu"),
                                   engine.runner.attention_backend)  # fmt: skip
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    with torch.inference_mode():
        return engine.model.compute_logits(engine.model(ids, positions, engine.kv_caches, meta))
