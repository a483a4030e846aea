"""Multiple choice scored the way lm-eval scores it: the log-likelihood of each choice as a
continuation of the context, through our engine's own model (`quality.Scorer`).

Tokens as lm-eval's `_encode_pair` makes them: the context alone and context + " " + choice
are tokenized, and the continuation is what the whole has past the context's tokens
(`benchmarks/lm_eval_crosscheck.py` checks this against lm-eval itself). Per
item: `correct` (lm-eval's acc: the highest log-likelihood is the answer), `correct_norm`
(acc_norm: log-likelihood divided by the choice's length in characters, as lm-eval's
`completion_len`) and `choice_prob`, a continuous score: the answer's probability among the
choices (softmax over their log-likelihoods), whose paired differences between variants
move by small amounts where acc flips whole items.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from modelship.pipeline.select.benchmark_data import ChoiceItem

TARGET_DELIMITER = " "  # lm-eval's default between context and choice


@dataclass(frozen=True)
class ChoiceScore:
    loglikelihoods: tuple[float, ...]
    correct: bool
    correct_norm: bool
    choice_prob: float


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids); the context's trailing whitespace (spaces and
    newlines alike, as lm-eval's `_encode_pair` strips it) moves to the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids) :]


def judge(item: ChoiceItem, loglikelihoods: list[float]) -> ChoiceScore:
    """acc, acc_norm and the answer's probability among the choices, from each choice's
    summed log-likelihood."""
    best = max(range(len(loglikelihoods)), key=lambda k: loglikelihoods[k])
    normed = [ll / len(choice) for ll, choice in zip(loglikelihoods, item.choices, strict=True)]
    best_norm = max(range(len(normed)), key=lambda k: normed[k])
    top = max(loglikelihoods)
    total = sum(math.exp(ll - top) for ll in loglikelihoods)
    return ChoiceScore(
        loglikelihoods=tuple(loglikelihoods),
        correct=best == item.answer,
        correct_norm=best_norm == item.answer,
        choice_prob=math.exp(loglikelihoods[item.answer] - top) / total,
    )


def score_choices(scorer, items: list[ChoiceItem]) -> list[ChoiceScore]:
    """Each item's scores (module docstring); `scorer` is a `quality.Scorer`."""
    sequences: list[list[int]] = []
    spans: list[tuple[int, list[int]]] = []  # (context length, continuation ids)
    for item in items:
        for choice in item.choices:
            context, continuation = encode_pair(
                scorer.tokenizer, item.context, TARGET_DELIMITER + choice
            )
            sequences.append(context + continuation)
            spans.append((len(context), continuation))
    loglikelihoods = []
    for (context_len, continuation), lp in zip(spans, scorer.logprobs(sequences), strict=True):
        rows = lp[context_len - 1 : context_len - 1 + len(continuation)]
        targets = torch.tensor(continuation)
        loglikelihoods.append(rows.gather(1, targets[:, None]).sum().item())
    out, at = [], 0
    for item in items:
        out.append(judge(item, loglikelihoods[at : at + len(item.choices)]))
        at += len(item.choices)
    return out
