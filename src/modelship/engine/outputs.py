"""Values that cross the engine's boundary: per-step deltas and finished request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's logprob and the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class SequenceDelta:
    """What one completion (`index` of `request_id`) produced in one engine step.

    `text` holds only the newly detokenized text (it may be empty while a partial UTF-8
    character or a possible stop string is held back); `finish_reason` is set on the
    sequence's last delta ("stop", "length", "abort", or "error" with `error` set).
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    queue_time_s: float | None = None  # arrival to first scheduled step, on the last delta
    # Per prompt position (None for the first token), on a sequence's first delta when
    # `SamplingParams.prompt_logprobs` is set.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With finish_reason "error": why the request failed inside the step (it alone).
    error: str | None = None
    # An embedding request's pooled hidden states (`SamplingParams.pooling`), on its delta
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's shape)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(entry.logprob for entry in self.logprobs)

    def extend(self, delta: SequenceDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass
class RequestOutput:
    """A request's completions, as returned by `LLM.generate` (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With finish_reason "error": why the request failed inside the step (it alone).
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(output.finish_reason is not None for output in self.outputs)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for metrics; counters are totals since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by sequences, 0..1
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # prompt tokens found there
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    spec_num_drafts: int = 0  # steps of a sequence that verified drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
