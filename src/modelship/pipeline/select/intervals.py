"""Select's item-based measures, each with a paired 95% bootstrap interval (`bootstrap.py`).

Five pools of items are resampled, each the same way for every variant and the base:
"passages" (the held-out chunks: perplexity, top-1 agreement, KL), "tasks" (task
accuracy), "tools" (tool-call success), "benchmark" (the standard multiple-choice set when
configured: acc, acc_norm and the answer's probability among the choices,
`multiple_choice.py`) and "golden" (the golden prompts' outputs: repeated 4-grams,
printable characters). A variant's numbers on a resample are computed from the
items drawn, and so are the base's, so the quality share on a resample compares the two on
the same items.

Quality share of the base (what the quality gate and score read) is the mean of the
retentions against the base, each capped at 1: task accuracy (variant / base; 1 when the
base scores 0), held-out cross-entropy (base nats per token / variant nats per token), and,
where the base calls any tool right on the whole set, tool-call success (variant / base; 1
on a resample where the base calls none right), and, where the standard multiple-choice set
was measured, its acc_norm (variant / base). Degeneration is pooled over all golden
outputs (repeated 4-grams / all 4-grams, printable / all characters), not read off the
worst single prompt: one prompt that loops is a quarter of the evidence, not all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from modelship.pipeline.select.bootstrap import (
    Interval,
    Resampler,
    identity,
    mean_over,
    paired_difference,
    percentile_interval,
    ratio_over,
)

QUALITY_METRICS = (
    "perplexity",
    "top1_agreement",
    "kl_divergence",
    "task_accuracy",
    "tool_call_success",
    "benchmark_acc",
    "benchmark_acc_norm",
    "benchmark_choice_prob",
)


@dataclass(frozen=True)
class Measured:
    """A number measured on the whole item set, with its 95% bootstrap interval."""

    value: float
    interval: Interval

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "ci95": self.interval.to_list()}


@dataclass
class VariantIntervals:
    """One variant's item-based measures. `share_replicates` are its quality shares on the
    shared resamples, what paired differences with another variant are taken over."""

    quality: dict[str, Measured]
    share: Measured | None = None
    share_replicates: np.ndarray | None = None
    repetition: Measured | None = None
    printable: Measured | None = None

    def difference(self, other: VariantIntervals) -> Measured:
        """This variant's quality share minus `other`'s, paired."""
        if self.share is None or other.share is None:
            raise ValueError("a quality share difference needs two measured variants")
        return Measured(
            self.share.value - other.share.value,
            paired_difference(self.share_replicates, other.share_replicates),
        )


def _pool_indices(items: dict[str, list], resampler: Resampler) -> dict[str, np.ndarray]:
    sizes = {
        "passages": len(items["passage_tokens"]),
        "tasks": len(items["task_correct"]),
        "tools": len(items["tool_correct"]),
        "benchmark": len(items.get("benchmark_correct") or ()),
    }
    return {pool: resampler.indices(pool, n) for pool, n in sizes.items() if n}


def quality_replicates(items: dict[str, list], indices: dict[str, np.ndarray]) -> dict[str, Any]:
    """Each quality metric (and nats per token) on each resample: metric -> [num_resamples]."""
    out: dict[str, Any] = {}
    if "passages" in indices:
        at = indices["passages"]
        tokens = items["passage_tokens"]
        out["nll_per_token"] = ratio_over(items["passage_nll"], tokens, at)
        with np.errstate(over="ignore"):
            out["perplexity"] = np.exp(out["nll_per_token"])
        out["top1_agreement"] = ratio_over(items["passage_agree"], tokens, at)
        out["kl_divergence"] = np.maximum(ratio_over(items["passage_kl"], tokens, at), 0.0)
    if "tasks" in indices:
        out["task_accuracy"] = mean_over(items["task_correct"], indices["tasks"])
    if "tools" in indices:
        out["tool_call_success"] = mean_over(items["tool_correct"], indices["tools"])
    if "benchmark" in indices:
        at = indices["benchmark"]
        out["benchmark_acc"] = mean_over(items["benchmark_correct"], at)
        out["benchmark_acc_norm"] = mean_over(items["benchmark_correct_norm"], at)
        out["benchmark_choice_prob"] = mean_over(items["benchmark_choice_prob"], at)
    return out


def quality_share(mine: dict[str, Any], ref: dict[str, Any], with_tools: bool) -> np.ndarray:
    """The quality share (module docstring) on each resample: arrays of equal shape in, out."""

    def retention(variant: Any, base: Any) -> np.ndarray:
        variant, base = np.asarray(variant, np.float64), np.asarray(base, np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            kept = np.where(base > 0, variant / np.where(base > 0, base, 1.0), 1.0)
        return np.minimum(kept, 1.0)

    def entropy(variant: Any, base: Any) -> np.ndarray:
        variant, base = np.asarray(variant, np.float64), np.asarray(base, np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            kept = np.where(variant > 0, base / np.where(variant > 0, variant, 1.0), 1.0)
        return np.minimum(kept, 1.0)

    shares = [
        retention(mine["task_accuracy"], ref["task_accuracy"]),
        entropy(mine["nll_per_token"], ref["nll_per_token"]),
    ]
    if with_tools:
        shares.append(retention(mine["tool_call_success"], ref["tool_call_success"]))
    if "benchmark_acc_norm" in ref:
        shares.append(retention(mine["benchmark_acc_norm"], ref["benchmark_acc_norm"]))
    return np.mean(shares, axis=0)


def estimate(
    evaluations: dict[str, dict[str, Any]], base: str, resampler: Resampler
) -> dict[str, VariantIntervals]:
    """Every measured variant's (and the base's) item-based measures with intervals; those
    that could not be measured are absent. Raises ValueError if a variant was measured on
    other items than the base (the pairing would be meaningless)."""
    ref_items = evaluations[base]["quality"]["items"]
    sizes = {key: len(values) for key, values in ref_items.items()}
    indices = _pool_indices(ref_items, resampler)
    whole = {pool: identity(len(at[0])) for pool, at in indices.items()}
    ref_reps = quality_replicates(ref_items, indices)
    ref_point = quality_replicates(ref_items, whole)
    with_tools = float(ref_point.get("tool_call_success", [0.0])[0]) > 0
    out: dict[str, VariantIntervals] = {}
    for name, evaluation in evaluations.items():
        items = (evaluation.get("quality") or {}).get("items")
        if evaluation.get("load_error") or items is None:
            continue
        if {key: len(values) for key, values in items.items()} != sizes:
            raise ValueError(f"{name} was measured on other items than {base}")
        reps, point = quality_replicates(items, indices), quality_replicates(items, whole)
        result = VariantIntervals(
            quality={
                metric: Measured(float(point[metric][0]), percentile_interval(reps[metric]))
                for metric in QUALITY_METRICS
                if metric in reps
            }
        )
        if name != base:
            result.share_replicates = quality_share(reps, ref_reps, with_tools)
            share = float(quality_share(point, ref_point, with_tools)[0])
            result.share = Measured(share, percentile_interval(result.share_replicates))
        checks = (evaluation.get("serving") or {}).get("golden_checks")
        if checks:
            _degeneration(result, checks, resampler)
        out[name] = result
    return out


def _degeneration(result: VariantIntervals, checks: list[dict], resampler: Resampler) -> None:
    at, whole = resampler.indices("golden", len(checks)), identity(len(checks))
    for field, numerator, denominator in (
        ("repetition", "repeated_ngrams", "ngrams"),
        ("printable", "printable_chars", "chars"),
    ):
        num = [c[numerator] for c in checks]
        den = [c[denominator] for c in checks]
        value = float(ratio_over(num, den, whole)[0])
        setattr(result, field, Measured(value, percentile_interval(ratio_over(num, den, at))))
