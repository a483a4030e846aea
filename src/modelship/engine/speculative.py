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

Drafting costs a step k more rows; a sequence whose drafts keep being rejected stops
drafting (`SpeculationTracker`), so open-ended text is not slowed by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from modelship.engine.sequence import Sequence

# A sequence stops drafting once this many of its draft tokens were checked and fewer than
# this share was accepted: below it, a CPU step's extra rows cost more than they save.
PROBE_DRAFT_TOKENS = 16
MIN_ACCEPTANCE_RATE = 0.3


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

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft', got {self.method!r}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("speculative_model (the draft model's path) goes with method 'draft'")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")


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
    """Per-sequence draft accounting and the engine's counters (vLLM's metric names)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_drafts = 0  # verified steps that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._per_seq: dict[str, list[int]] = {}  # seq_id -> [drafted, accepted]

    def wants(self, seq: Sequence, speculate: bool | None) -> bool:
        """Whether `seq` drafts this step: it asked to (None: the engine's default) and its
        drafts have not kept failing."""
        if not (self.config.by_default if speculate is None else speculate):
            return False
        drafted, accepted = self._per_seq.get(seq.seq_id, (0, 0))
        return drafted < PROBE_DRAFT_TOKENS or accepted >= MIN_ACCEPTANCE_RATE * drafted

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        config = self.config
        limit = min(config.num_tokens, max_tokens)
        if limit < 1:
            return []
        return propose_ngram(seq.token_ids, limit, config.min_ngram, config.max_ngram)

    def record(self, seq_id: str, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        counts = self._per_seq.setdefault(seq_id, [0, 0])
        counts[0] += num_drafted
        counts[1] += num_accepted

    def forget(self, seq_id: str) -> None:
        self._per_seq.pop(seq_id, None)
