"""Per-request sampling parameters (the `*Params` of one request)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; seeds are int64 (as in vLLM's and
# OpenAI's APIs), so `seed + index` of every sibling still fits.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
# Seen tokens' logits are divided (positive) or multiplied (negative) by the penalty: past
# these bounds a float32 logit overflows to inf (1e-300 made every seen positive logit
# +inf), which the sampler takes for a broken model and stops the engine on. Useful
# penalties lie near 1.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# OpenAI's bounds on `logit_bias`: entries per request, and each bias's magnitude.
MAX_LOGIT_BIAS_ENTRIES, MAX_LOGIT_BIAS = 300, 100.0


class InvalidParamsError(ValueError):
    """A sampling parameter is out of range; `param` names the field (the API maps it to 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


POOLINGS = (None, "last", "mean")


@dataclass
class SamplingParams:
    """How to sample one request's completion(s). Mirrors vLLM's `SamplingParams` fields.

    temperature == 0 (or below 1e-5) means greedy. `top_k` <= 0 and `top_p` == 1 and
    `min_p` == 0 disable those filters. `seed` makes sampling reproducible for this request
    regardless of which other requests share its batch. `logprobs` is the number of top
    alternatives to return per generated token (None: no logprobs; 0: only the sampled
    token's logprob). Construction checks every field's type and range (finite numbers,
    an int64 seed); `verify(vocab_size)` adds the checks that need the model.
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
    # token id -> a bias added to its logit before penalties and temperature (OpenAI's
    # `logit_bias`): 100 all but forces the token, -100 all but bans it
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # speculative decoding for this request where the engine has it on (None: the engine's
    # default); output and its distribution are the same either way
    speculative: bool | None = None
    # The prompt's last `num_resumed_tokens` are output an earlier replica already streamed
    # (a gateway's failover continuation): they are detokenized as output, so text merges
    # and stop strings run on across the cut as in one uninterrupted run. `max_tokens` and
    # `min_tokens` count only what is still to come. Penalties and a seeded generator see
    # only the new tokens (a sampled continuation is valid, not identical).
    num_resumed_tokens: int = 0
    # An embedding request: the prompt's final hidden states pooled, "last" (the last
    # token's) or "mean" (over every prompt position), and set on the sequence's delta
    # (`SequenceDelta.embedding`) once its prompt is computed. The one sampled token is
    # not the point: such requests ask for max_tokens=1.
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check()

    def _check(self) -> None:
        for param in _INTS:
            value = getattr(self, param)
            if not (value is None and param in _OPTIONAL) and not _is_int(value):
                raise InvalidParamsError(param, f"{param} must be an integer")
        for param in _FLOATS:
            value = getattr(self, param)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidParamsError(param, f"{param} must be a number")
            if not math.isfinite(value):
                raise InvalidParamsError(param, f"{param} must be a finite number")
        checks = [
            ("n", self.n >= 1, "n must be at least 1"),
            (
                "max_tokens",
                self.max_tokens is None or self.max_tokens >= 1,
                "max_tokens must be at least 1",
            ),
            ("min_tokens", self.min_tokens >= 0, "min_tokens must be non-negative"),
            (
                "num_resumed_tokens",
                self.num_resumed_tokens >= 0,
                "num_resumed_tokens must be non-negative",
            ),
            ("temperature", self.temperature >= 0.0, "temperature must be non-negative"),
            ("pooling", self.pooling in POOLINGS, "pooling must be None, 'last' or 'mean'"),
            ("top_p", 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "top_k must be -1, 0 (disabled) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (
                "seed",
                self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
                f"seed must be in [{SEED_MIN}, {SEED_MAX}]",
            ),
            (
                "repetition_penalty",
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY}]",
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
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                "stop",
                all(isinstance(s, str) for s in self.stop),
                "stop must be a string or a list of strings",
            ),
            (
                "stop_token_ids",
                all(_is_int(t) for t in self.stop_token_ids),
                "stop_token_ids must be a list of integers",
            ),
        ]
        for param, ok, message in checks:
            if not ok:
                raise InvalidParamsError(param, message)
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidParamsError(
                "logit_bias",
                f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases",
            )
        for token_id, value in bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise InvalidParamsError("logit_bias", "logit_bias keys must be token ids")
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS  # NaN fails too
            ):
                raise InvalidParamsError(
                    "logit_bias",
                    f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}] (token {token_id})",
                )

    def verify(self, vocab_size: int) -> None:
        """Every check again (the fields may have been changed since construction), then
        the ones that need the model: raises `InvalidParamsError` for a `top_k` or a
        number of logprobs or a `logit_bias` token beyond the vocabulary (the sampler would
        index past it)."""
        self._check()
        outside = [t for t in self.logit_bias or () if t >= vocab_size]
        if outside:
            raise InvalidParamsError(
                "logit_bias", f"logit_bias: token id {outside[0]} is not in [0, {vocab_size})"
            )
        if self.top_k > vocab_size:
            raise InvalidParamsError("top_k", f"top_k must be at most the vocab size, {vocab_size}")
        for param in ("logprobs", "prompt_logprobs"):
            value = getattr(self, param)
            if value is not None and value > vocab_size:
                raise InvalidParamsError(
                    param, f"{param} must be at most the vocab size, {vocab_size}"
                )

    @property
    def is_greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf and the softmax to NaN.
        return self.temperature < _MIN_TEMPERATURE


_MIN_TEMPERATURE = 1e-5
_INTS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs",
         "num_resumed_tokens")  # fmt: skip
_OPTIONAL = ("max_tokens", "seed", "logprobs", "prompt_logprobs")
_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
