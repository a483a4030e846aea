"""Sampling as pure functions over logits and per-row tensors, with an explicit greedy path.

Order: logit bias -> penalties -> logprobs (of the penalized distribution, before temperature and
filters: the model's view, as OpenAI-style APIs report it) -> greedy rows take the argmax;
random rows: temperature -> top-k -> top-p -> min-p -> exponential race. Each seeded row
draws its noise from its own generator, so a seeded request samples the same tokens
whatever else shares its batch.

A row whose own logits (before the request's penalties) hold a NaN, or whose largest logit
is infinite, has no distribution to sample from (broken weights or an overflow): `sample`
lists it in `SamplerOutput.nonfinite_rows` instead of picking a token for it (argmax would
pick the first NaN, token after token, and the client would get a plausible-looking answer
of garbage); the engine fails those requests alone with `NonFiniteLogitsError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from modelship.engine.sampling_params import SamplingParams


@dataclass
class LogitBias:
    """The batch's `logit_bias` entries, flattened: entry i adds `values[i]` to the logit of
    `token_ids[i]` in row `rows[i]` (a few hundred entries at most per row, never a dense
    [batch, vocab] tensor)."""

    rows: torch.Tensor  # [num_entries] int64
    token_ids: torch.Tensor  # [num_entries] int64
    values: torch.Tensor  # [num_entries] float32

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device | str) -> LogitBias | None:
        entries = [(row, token_id, value) for row, p in enumerate(params)
                   for token_id, value in (p.logit_bias or {}).items()]  # fmt: skip
        if not entries:
            return None
        rows, token_ids, values = zip(*entries, strict=True)
        return cls(
            rows=torch.tensor(rows, dtype=torch.long, device=device),
            token_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
            values=torch.tensor(values, dtype=torch.float32, device=device),
        )


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one batch, as tensors ([batch] unless noted)."""

    temperature: torch.Tensor
    top_k: torch.Tensor  # int64, vocab_size where disabled
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    prompt_mask: torch.Tensor | None  # [batch, vocab] bool: token occurs in the prompt
    output_counts: torch.Tensor | None  # [batch, vocab] float: occurrences in the output
    generators: list[torch.Generator | None]
    logit_bias: LogitBias | None  # None: no row has one
    greedy: list[bool]
    all_greedy: bool
    needs_penalties: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    max_num_logprobs: int  # -1: no row asked for logprobs

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        def column(values, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        needs_penalties = any(
            p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params
        )
        prompt_mask = output_counts = None
        if needs_penalties:
            prompt_mask = _token_counts(prompt_token_ids, vocab_size, device) > 0
            output_counts = _token_counts(output_token_ids, vocab_size, device)
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        greedy = [p.is_greedy for p in params]
        return cls(
            temperature=column([1.0 if p.is_greedy else p.temperature for p in params]),
            top_k=column(top_k, torch.long),
            top_p=column([p.top_p for p in params]),
            min_p=column([p.min_p for p in params]),
            repetition_penalty=column([p.repetition_penalty for p in params]),
            frequency_penalty=column([p.frequency_penalty for p in params]),
            presence_penalty=column([p.presence_penalty for p in params]),
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            generators=generators,
            logit_bias=LogitBias.build(params, device),
            greedy=greedy,
            all_greedy=all(greedy),
            needs_penalties=needs_penalties,
            needs_top_k=any(k < vocab_size for k in top_k),
            needs_top_p=any(p.top_p < 1.0 for p in params),
            needs_min_p=any(p.min_p > 0 for p in params),
            max_num_logprobs=min(
                max((p.logprobs for p in params if p.logprobs is not None), default=-1),
                vocab_size,
            ),
        )


class NonFiniteLogitsError(RuntimeError):
    """The model's logits for a sequence are NaN or infinite: no token can be sampled."""

    def __init__(self) -> None:
        super().__init__(
            "the model produced NaN or infinite logits for this sequence; its weights or "
            "activations are broken, so no token was sampled"
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [batch] int64
    logprobs: torch.Tensor | None  # [batch] logprob of the sampled token
    top_logprob_ids: torch.Tensor | None  # [batch, k]
    top_logprobs: torch.Tensor | None  # [batch, k], sorted descending
    # rows whose model logits were NaN/inf: their token is meaningless, their request fails
    nonfinite_rows: list[int] = field(default_factory=list)


def _token_counts(token_ids: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    width = max((len(ids) for ids in token_ids), default=0)
    counts = torch.zeros(len(token_ids), vocab_size + 1, device=device)
    if width:
        # pad with an extra "vocab_size" column that is dropped afterwards
        padded = torch.full((len(token_ids), width), vocab_size, dtype=torch.long, device=device)
        for row, ids in enumerate(token_ids):
            if ids:
                padded[row, : len(ids)] = torch.tensor(ids, device=device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    """`logits` with each row's biases added (a new tensor: the caller's is left as it was)."""
    return logits.index_put((bias.rows, bias.token_ids), bias.values.to(logits.dtype),
                            accumulate=True)  # fmt: skip


def apply_penalties(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output, HF semantics), frequency and presence (output, OpenAI)."""
    assert m.prompt_mask is not None and m.output_counts is not None
    seen = m.prompt_mask | (m.output_counts > 0)
    rep = m.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - m.frequency_penalty.unsqueeze(1) * m.output_counts
    return logits - m.presence_penalty.unsqueeze(1) * (m.output_counts > 0).to(logits.dtype)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's `top_k` largest logits (ties at the threshold are kept)."""
    sorted_logits = logits.sort(dim=-1, descending=True).values
    threshold = sorted_logits.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability mass reaches `top_p`."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
    drop_sorted = mass_before >= top_p.unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` times the top token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def random_sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p; rows use their own
    generator, so a row's draw does not depend on the other rows."""
    noise = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def process_logits(
    logits: torch.Tensor, m: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(penalized logits, scaled): the penalized logits are what greedy rows take the argmax
    of and logprobs are reported from; `scaled` (None when every row is greedy) holds the
    logits random rows draw from, softmax(scaled) being a row's final sampling
    distribution (temperature, top-k, top-p, min-p applied). Speculative verification
    reads the same two (`engine.speculative`)."""
    if m.logit_bias is not None:
        logits = apply_logit_bias(logits, m.logit_bias)
    if m.needs_penalties:
        # An extreme repetition penalty (1e-300, 1e308) overflows a logit to +-inf, and the
        # row's softmax to NaN: keep every penalized logit finite.
        limit = torch.finfo(logits.dtype).max
        logits = apply_penalties(logits, m).clamp_(-limit, limit)
    if m.all_greedy:
        return logits, None
    scaled = logits / m.temperature.unsqueeze(1)
    if m.needs_top_k:
        scaled = apply_top_k(scaled, m.top_k)
    if m.needs_top_p:
        scaled = apply_top_p(scaled, m.top_p)
    if m.needs_min_p:
        scaled = apply_min_p(scaled, m.min_p)
    return logits, scaled


def sample(
    logits: torch.Tensor,
    m: SamplingMetadata,
    verify: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], None] | None = None,
) -> SamplerOutput:
    """Sample one token per row of `logits` ([batch, vocab], float32). `verify(penalized,
    scaled, token_ids)` (speculative sampling with a draft model's probabilities) may
    replace tokens in `token_ids` before logprobs are taken of them."""
    # The model's own logits: the largest is finite iff the row has no NaN (amax propagates
    # it), no +inf and is not all -inf. Checked before the request's parameters touch
    # them, so only a broken model raises, never a client's extreme penalty. [batch]
    broken = ~torch.isfinite(logits.amax(dim=-1))
    nonfinite_rows = broken.nonzero().flatten().tolist() if broken.any() else []
    if nonfinite_rows:  # sample the others; these rows' tokens are never used
        logits = logits.masked_fill(broken.unsqueeze(1), 0.0)
    logits, scaled = process_logits(logits, m)
    logprobs = top_ids = top_values = None
    greedy_tokens = logits.argmax(dim=-1)
    if m.max_num_logprobs >= 0:
        all_logprobs = logits.log_softmax(dim=-1)
    if scaled is None:
        token_ids = greedy_tokens
    else:
        random_rows = [i for i, g in enumerate(m.greedy) if not g]
        rows = torch.tensor(random_rows, device=logits.device)
        drawn = random_sample(scaled[rows].softmax(dim=-1), [m.generators[i] for i in random_rows])
        token_ids = greedy_tokens.clone()
        token_ids[rows] = drawn
    if verify is not None:
        verify(logits, scaled, token_ids)
    if m.max_num_logprobs >= 0:
        logprobs = all_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if m.max_num_logprobs > 0:
            top_values, top_ids = all_logprobs.topk(m.max_num_logprobs, dim=-1)
    return SamplerOutput(token_ids, logprobs, top_ids, top_values, nonfinite_rows)
