"""modelship.engine: continuous batching over a paged KV cache with prefix caching.

Names are loaded on first use: the engine pulls in torch, and leaf modules such as
`engine.options` (read with every pipeline.yaml) must not.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "modelship.engine.llm",
    "AsyncLLMEngine": "modelship.engine.async_engine",
    "CompletionOutput": "modelship.engine.outputs",
    "EngineClient": "modelship.engine.client",
    "EngineConfig": "modelship.engine.config",
    "EngineCoreClient": "modelship.engine.core",
    "EngineDeadError": "modelship.engine.errors",
    "EngineOptions": "modelship.engine.options",
    "EngineOverloadedError": "modelship.engine.errors",
    "EngineRequest": "modelship.engine.request",
    "GrammarSpec": "modelship.engine.grammar_spec",
    "InvalidParamsError": "modelship.engine.sampling_params",
    "LLMEngine": "modelship.engine.llm_engine",
    "RequestOutput": "modelship.engine.outputs",
    "RequestFailedError": "modelship.engine.errors",
    "RequestTooLongError": "modelship.engine.errors",
    "SamplingParams": "modelship.engine.sampling_params",
    "SequenceDelta": "modelship.engine.outputs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'modelship.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
