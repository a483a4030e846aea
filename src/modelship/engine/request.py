"""`EngineRequest`: one request as it enters the engine, through either front.

A request (docs/architecture.md's word: what a client asks for) becomes `params.n`
sequences inside the engine. This is the one value the server hands a front, the thread
front queues for its engine thread, and the process front pickles over the core pipe; a
new per-request field (a constraint on what may be sampled, say) is added here once and
reaches `LLMEngine.add` on both paths.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelship.engine.grammar_spec import GrammarSpec
from modelship.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """What the engine needs to admit a request; the prompt is already tokenized.

    Prefix-cache blocks are shared only between requests with the same `cache_salt` (a
    tenant's cache namespace) and the same `lora` (the name of a LoRA adapter the engine
    holds; None for the base model). `constraint`: what the output must match (structured
    outputs, `engine.structured`); None for free text."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # higher is served first
    cache_salt: str | None = None
    lora: str | None = None
    constraint: GrammarSpec | None = None
