"""modelship: from a model name to a fast, autoscaled, OpenAI-compatible production API."""

from typing import Any

__version__ = "0.1.0"

# The engine pulls in torch; load it only when asked (`modelship.LLM`), not for the CLI.
_ENGINE_EXPORTS = {"LLM", "AsyncLLMEngine", "EngineConfig", "SamplingParams", "RequestOutput"}


def __getattr__(name: str) -> Any:
    if name in _ENGINE_EXPORTS:
        from modelship import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'modelship' has no attribute {name!r}")
