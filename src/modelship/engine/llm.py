"""`LLM`: offline batched generation with vLLM's call shape, for scripts and benchmarks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf
from pathlib import Path
from typing import Any

from modelship.engine.config import EngineConfig
from modelship.engine.llm_engine import LLMEngine
from modelship.engine.outputs import CompletionOutput, RequestOutput
from modelship.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model_path, **engine_config).generate(prompts, SamplingParams(...))`.

    Keyword arguments are `EngineConfig` fields. All prompts are queued at once and the
    engine batches them continuously; outputs come back in the order of the prompts.
    """

    def __init__(self, model_path: str | Path, **config: Any) -> None:
        self.engine = LLMEngine(model_path, EngineConfig(**config))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        priority: SequenceOf[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # one prompt, as text or token ids
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        priorities = list(priority) if priority is not None else [0] * len(prompts)

        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        try:
            for prompt, params, prio in zip(prompts, sampling_params, priorities, strict=True):
                request_id = f"llm-{next(self._ids)}"
                prompt_token_ids = self.engine.add_request(
                    request_id, prompt, params, priority=prio
                )
                order.append(request_id)
                results[request_id] = RequestOutput(
                    request_id,
                    prompt if isinstance(prompt, str) else None,
                    prompt_token_ids,
                    [CompletionOutput(index=i) for i in range(params.n)],
                )
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    output = results[delta.request_id]
                    output.outputs[delta.index].extend(delta)
                    output.num_cached_tokens = max(
                        output.num_cached_tokens, delta.num_cached_tokens
                    )
                    if delta.prompt_logprobs is not None:
                        output.prompt_logprobs = delta.prompt_logprobs
        except BaseException:
            # A prompt that fails admission, a step that raises, or Ctrl-C: this call's
            # requests leave the engine with it (blocks freed), so the next call starts clean.
            for request_id in order:
                self.engine.abort(request_id)
            raise
        return [results[request_id] for request_id in order]
