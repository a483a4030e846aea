"""Prefix-cache namespaces through the engine: a salt keeps tenants' prompts apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelship.engine import SamplingParams
from modelship.engine.config import EngineConfig
from modelship.engine.llm_engine import LLMEngine

PROMPT = list(range(3, 43))  # 40 tokens: 9 full blocks of 4 can be hit (one is recomputed)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine(tiny_llama_dir, EngineConfig(dtype="float32", block_size=4, num_kv_blocks=64))


def run(engine: LLMEngine, request_id: str, salt: str | None, n: int = 1) -> int:
    """Run one request to the end; returns the prompt tokens the prefix cache served."""
    hits = engine.block_manager.prefix_hits
    params = SamplingParams(n=n, temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request(request_id, PROMPT, params, cache_salt=salt)
    while engine.has_unfinished():
        engine.step()
    return engine.block_manager.prefix_hits - hits


def test_a_salted_prefix_is_hit_only_under_the_same_salt(engine: LLMEngine) -> None:
    engine.block_manager.reset_prefix_cache()
    assert run(engine, "a1", "tenant:alpha") == 0
    assert run(engine, "b1", "tenant:beta") == 0  # the same prompt, another tenant: no hit
    assert run(engine, "u1", None) == 0
    assert run(engine, "a2", "tenant:alpha") == 36
    assert run(engine, "b2", "tenant:beta") == 36
    assert run(engine, "u2", None) == 36
    engine.block_manager.check_integrity()


def test_siblings_of_a_salted_request_share_its_prompt(engine: LLMEngine) -> None:
    engine.block_manager.reset_prefix_cache()
    # The first sequence computes the prompt; its two held-back siblings hit its blocks.
    assert run(engine, "n3", "tenant:gamma", n=3) == 2 * 36
    engine.block_manager.check_integrity()
