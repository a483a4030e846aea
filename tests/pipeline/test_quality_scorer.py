"""select's Scorer sizes its KV cache from the model it loads."""

from __future__ import annotations

from pathlib import Path

import torch

from modelship.pipeline.select.quality import MIN_KV_CACHE_BYTES, Scorer, kv_cache_bytes


def test_the_scorers_kv_cache_holds_one_sequence_of_a_model_whose_cache_is_large(
    tiny_llama_dir: Path,
) -> None:
    """A fixed 64 MiB cache failed the float32 demo base at 2048 tokens (KVCacheTooSmallError,
    select gave up); here the tiny model's 512 bytes a token at 2x as many tokens as fit."""
    from modelship.engine import EngineConfig

    per_token = kv_cache_bytes(tiny_llama_dir, EngineConfig(), 16) // 16
    max_model_len = 2 * MIN_KV_CACHE_BYTES // per_token
    scorer = Scorer(tiny_llama_dir, max_model_len=max_model_len)
    assert scorer.engine.worker.num_blocks * scorer.engine.worker.block_size >= max_model_len
    (logprobs,) = scorer.logprobs([[1, 2, 3, 4]])
    assert logprobs.shape[0] == 3 and torch.isfinite(logprobs).all()
