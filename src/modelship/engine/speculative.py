"""Speculative decoding: drafts by prompt lookup (the sequence's own tokens) or from a
smaller draft model (`engine.draft`), verified by the target model in one step.

Drafting (no second model): find the latest earlier occurrence of the sequence's last n
tokens (n from `max_ngram` down to `min_ngram`) and propose the k tokens that followed it.
Text that repeats or quotes its input (summaries, edits, code, extraction) is full of such
continuations.

Verification keeps the target distribution exact. A prompt-lookup draft is a point mass
q = delta(d), so the rejection rule of speculative sampling (accept d with probability
min(1, p(d) / q(d)) = p(d), else draw from (p - q)+ normalized) reduces to: draw t ~ p with
the request's own sampler; accept the draft iff t == d; otherwise emit t. The emitted token
has distribution p whatever the draft was, and greedy rows (t = argmax p) emit exactly the
tokens of plain decoding. So the engine samples every verified row as it samples any row
(penalties see the drafts before the row as output), keeps the longest prefix of drafts
that match the samples, and emits the sample after it: 1 to k + 1 tokens per step.

A draft model's drafts come with its probabilities q (the draft's distribution under the
request's own processing: penalties, temperature, top-k/top-p/min-p). Sampled rows then
take the full rule (`verify_draft_probs`): accept d with probability min(1, p(d) / q(d)),
on rejection emit a draw from normalize(max(0, p - q)), and when all k are accepted the
bonus token is the row's own draw from p. Greedy rows keep the rule above (accept iff
argmax p == d): tokens identical to plain decoding.

Drafting costs a step k more rows, and on a CPU rows are not free: a step verifying 4
drafts of the demo model's int4 release costs about 2.2 plain steps. So each step every
sequence drafts the number of tokens that pays best for it (`SpeculationTracker`): with
alpha its estimated chance that a draft is accepted (accepted drafts over accepted drafts
plus rejections, starting from an optimistic prior), k drafts emit (1 - alpha^(k+1)) /
(1 - alpha) tokens for 1 + k x `draft_token_cost` steps' time; the k in 1..num_tokens with
the best ratio is drafted, none when no k gains at least `MIN_GAIN`. In a batch the
other sequences wait for the drafted rows too, so a drafted token costs more there; a
sequence for which no k would pay even alone stops drafting. Open-ended text, where few
drafts are accepted, stops after a few cheap one-token probes; text that quotes its input
drafts long runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from modelship.engine.sequence import Sequence

# The prior of a sequence's acceptance estimate: as if it had had this many drafts accepted
# and rejected (3 in 4: a fresh sequence drafts, and two or three failed probes stop it).
PRIOR_ACCEPTED = 3.0
PRIOR_REJECTED = 1.0
# Draft only when the expected tokens per unit of step time beat plain decoding by this
# much: the estimate is rough, and the lookup has its own cost.
MIN_GAIN = 1.05


def expected_gain(acceptance: float, num_drafts: int, draft_token_cost: float) -> float:
    """Tokens per plain step's time with `num_drafts` drafts: each draft is accepted with
    probability `acceptance` given the one before it was; the step emits the accepted run
    and the token after it, and costs 1 + num_drafts x draft_token_cost plain steps."""
    if acceptance >= 1.0:
        tokens = num_drafts + 1.0
    else:
        tokens = (1.0 - acceptance ** (num_drafts + 1)) / (1.0 - acceptance)
    return tokens / (1.0 + num_drafts * draft_token_cost)


@dataclass(frozen=True)
class SpeculativeConfig:
    num_tokens: int  # k: draft tokens verified per step
    min_ngram: int = 1
    max_ngram: int = 3
    by_default: bool = False  # requests that do not say speculate iff this
    max_batch_size: int = 2  # no drafting in steps with more running sequences (CPU: see docs)
    # "ngram": prompt lookup; "draft": a smaller model of the same tokenizer at `draft_model`
    method: Literal["ngram", "draft"] = "ngram"
    draft_model: str | None = None
    # What a drafted token adds to a step's time, as a share of a plain decode step: about
    # 0.3 for the demo model's int4 release on a 2-core AVX2 CPU (benchmarks/speculative.py),
    # near 0 on a GPU; a draft model's own step adds to it.
    draft_token_cost: float = 0.3

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft', got {self.method!r}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("speculative_model (the draft model's path) goes with method 'draft'")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        if self.draft_token_cost < 0:
            raise ValueError("draft_token_cost must be >= 0")


def propose_ngram(
    token_ids: list[int], num_tokens: int, min_ngram: int, max_ngram: int
) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the last n
    tokens (longest n first); [] when none occurs."""
    length = len(token_ids)
    if length < min_ngram + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = tokens[length - n :]
        # windows starting at 0 .. length - n - 1: every occurrence before the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + num_tokens].tolist()
    return []


def accepted_prefix(drafts: list[int], samples: list[int]) -> list[int]:
    """The tokens a verified step emits: the drafts that match the samples of the rows before
    them, then the sample after the last match (len(samples) == len(drafts) + 1)."""
    emitted = []
    for draft, sample in zip(drafts, samples, strict=False):
        emitted.append(sample)
        if draft != sample:
            return emitted
    emitted.append(samples[len(drafts)])
    return emitted


@dataclass
class DraftCheck:
    """One sampled sequence's drafts with the draft model's probabilities, for
    `verify_draft_probs`: rows `start .. start + len(drafts)` of the step (the last one is
    the bonus row)."""

    start: int
    drafts: list[int]
    probs: torch.Tensor  # [len(drafts), vocab] fp32: q of each draft row
    generator: torch.Generator | None


def verify_draft_probs(
    scaled: torch.Tensor | None, token_ids: torch.Tensor, checks: list[DraftCheck]
) -> None:
    """Speculative sampling for sampled rows with draft probabilities: rewrites
    `token_ids` [rows] so that row `start + i` holds draft i where it is accepted (drawn
    with probability min(1, p/q)) and, at the first rejection, a draw from
    normalize(max(0, p - q)) instead (never equal to the draft, so `accepted_prefix` stops
    there). A sequence whose drafts are all accepted keeps its bonus row's draw from p.
    p = softmax(`scaled`), the rows' final sampling distribution (`sampler.process_logits`)."""
    if scaled is None or not checks:
        return
    for check in checks:
        num_drafts = len(check.drafts)
        p = scaled[check.start : check.start + num_drafts].float().softmax(dim=-1)
        q = check.probs[:num_drafts].to(p.device)
        uniform = torch.rand(num_drafts, generator=check.generator, device=p.device)
        for i, draft in enumerate(check.drafts):
            if uniform[i] * q[i, draft] <= p[i, draft]:  # accept: u <= p(d) / q(d)
                token_ids[check.start + i] = draft
                continue
            residual = (p[i] - q[i]).clamp_(min=0)
            if residual.sum() <= 0:  # p == q up to rounding: rejection had probability ~0
                residual = p[i]
            token_ids[check.start + i] = torch.multinomial(residual, 1, generator=check.generator)
            break


class SpeculationTracker:
    """Per-sequence acceptance and the number of drafts that pays for it, and the engine's
    counters (vLLM's metric names)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_drafts = 0  # verified steps that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._per_seq: dict[str, list[int]] = {}  # seq_id -> [accepted, rejections]
        self._stopped: set[str] = set()  # sequences whose drafts no longer pay

    def acceptance(self, seq_id: str) -> float:
        """The estimated chance that a draft of `seq_id` is accepted, given the one before
        it was: accepted drafts over accepted drafts plus rejections, with the prior."""
        accepted, rejections = self._per_seq.get(seq_id, (0, 0))
        return (accepted + PRIOR_ACCEPTED) / (
            accepted + rejections + PRIOR_ACCEPTED + PRIOR_REJECTED
        )

    def num_to_draft(
        self, seq: Sequence, speculate: bool | None, room: int, batch_size: int = 1
    ) -> int:
        """How many tokens `seq` drafts this step (0: none): it asked to (None: the
        engine's default), and the k in 1..min(num_tokens, room) with the best expected
        gain gains at least MIN_GAIN. In a step of `batch_size` sequences, every one of
        them waits for the drafted rows: a row costs c x B / (1 + c x (B - 1)) of the plain
        step, c = `draft_token_cost` (at B = 8 and c = 0.3: 0.77). A sequence for which no
        k would pay even alone stops drafting."""
        if not (self.config.by_default if speculate is None else speculate):
            return 0
        if seq.grammar is not None:  # drafts are not checked against a grammar (yet)
            return 0
        if seq.seq_id in self._stopped or room < 1:
            return 0
        alpha = self.acceptance(seq.seq_id)
        alone = self.config.draft_token_cost
        most = min(self.config.num_tokens, room)
        if max(expected_gain(alpha, k, alone) for k in range(1, most + 1)) < MIN_GAIN:
            self._stopped.add(seq.seq_id)
            return 0
        cost = alone * batch_size / (1.0 + alone * (batch_size - 1))
        gain, best = max((expected_gain(alpha, k, cost), k) for k in range(1, most + 1))
        return best if gain >= MIN_GAIN else 0

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        config = self.config
        return propose_ngram(seq.token_ids, num_tokens, config.min_ngram, config.max_ngram)

    def record(self, seq_id: str, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        counts = self._per_seq.setdefault(seq_id, [0, 0])
        counts[0] += num_accepted
        counts[1] += int(num_accepted < num_drafted)

    def forget(self, seq_id: str) -> None:
        self._per_seq.pop(seq_id, None)
        self._stopped.discard(seq_id)
