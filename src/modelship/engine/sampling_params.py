"""Per-request sampling parameters (the `*Params` of one request)."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidParamsError(ValueError):
    """A sampling parameter is out of range; `param` names the field (the API maps it to 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to sample one request's completion(s). Mirrors vLLM's `SamplingParams` fields.

    temperature == 0 means greedy. `top_k` <= 0 and `top_p` == 1 and `min_p` == 0 disable
    those filters. `seed` makes sampling reproducible for this request regardless of which
    other requests share its batch. `logprobs` is the number of top alternatives to return
    per generated token (None: no logprobs; 0: only the sampled token's logprob).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            ("n", self.n >= 1, "n must be at least 1"),
            (
                "max_tokens",
                self.max_tokens is None or self.max_tokens >= 1,
                "max_tokens must be at least 1",
            ),
            ("min_tokens", self.min_tokens >= 0, "min_tokens must be non-negative"),
            ("temperature", self.temperature >= 0.0, "temperature must be non-negative"),
            ("top_p", 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "top_k must be -1, 0 (disabled) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (
                "repetition_penalty",
                self.repetition_penalty > 0.0,
                "repetition_penalty must be positive",
            ),
            (
                "frequency_penalty",
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty must be in [-2, 2]",
            ),
            (
                "presence_penalty",
                -2.0 <= self.presence_penalty <= 2.0,
                "presence_penalty must be in [-2, 2]",
            ),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= 20,
                "logprobs must be in [0, 20]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs must be in [0, 20]",
            ),
        ]
        for param, ok, message in checks:
            if not ok:
                raise InvalidParamsError(param, message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
