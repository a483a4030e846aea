"""modelship.engine: continuous batching over a paged KV cache with prefix caching."""

from modelship.engine.async_engine import AsyncLLMEngine
from modelship.engine.config import EngineConfig
from modelship.engine.core import EngineCoreClient
from modelship.engine.errors import EngineDeadError, EngineOverloadedError, RequestTooLongError
from modelship.engine.llm import LLM
from modelship.engine.llm_engine import LLMEngine
from modelship.engine.outputs import CompletionOutput, RequestOutput, SequenceDelta
from modelship.engine.sampling_params import InvalidParamsError, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineCoreClient",
    "EngineDeadError",
    "EngineOverloadedError",
    "InvalidParamsError",
    "LLMEngine",
    "RequestOutput",
    "RequestTooLongError",
    "SamplingParams",
    "SequenceDelta",
]
