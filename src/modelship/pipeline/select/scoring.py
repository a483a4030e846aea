"""Scoring variants: hard gates first, then metrics normalized to 0..1 and weighted.

Pure functions over measured numbers, so the choice can be tested and explained exactly.
Quality is a share of the base model's quality and is scored on a fixed scale anchored at
the quality gate: the gate scores 0, the base's quality 1 (min-max would turn any
small loss into a full point lost, however small). The other metrics are
normalized min-max across the variants that passed the gates; for metrics where lower is
better (latency, memory) the scale is flipped. With a single survivor, or when all
survivors measure the same, every survivor scores 1 on that metric. A group's score is the
mean of its metrics' normalized values, the total the weighted sum of the group scores
(weights normalized to sum to 1); `report.normalization_note` states it for the reader.

Gates read intervals where there are any: a gate fires only when the whole 95% interval
is on the wrong side of it; an interval that straddles the gate passes with a warning.
Quality's interval is a bootstrap over the items it was measured on (`intervals.py`);
degeneration's over the golden prompts.

Measured numbers carry noise, and a difference inside the noise is a tie: walking from the
best value down, a variant that does not differ from the leader of its tie group scores as
that leader (`tie_leaders`). Serving metrics (95% half-widths from repeated rounds) differ
when their intervals do not overlap and the gap is at least `min_effect` (`stats.differ`);
quality shares differ when the paired bootstrap interval of their difference (same
resampled items for both) excludes zero. So a variant cannot win on noise, and two copies
of the same weights tie. When the top scores are equal, the ranking falls to the groups in
order of weight (quality first by default), then to the variant name, and `tie_at_top`
says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from modelship.pipeline.select.bootstrap import Interval, paired_difference
from modelship.pipeline.select.stats import differ

# metric -> (group, higher_is_better)
METRICS: dict[str, tuple[str, bool]] = {
    "quality": ("quality", True),  # composite share of the base model's quality, 0..1
    "ttft_s": ("latency", False),
    "tpot_s": ("latency", False),
    "throughput_tok_s": ("throughput", True),
    "weight_bytes": ("memory", False),
    "peak_rss_bytes": ("memory", False),
}
# Metrics measured through a serving replica: noisy, compared with `min_effect`. Quality
# (teacher-forced, deterministic) and weight bytes are exact.
NOISY_METRICS = frozenset({"ttft_s", "tpot_s", "throughput_tok_s", "peak_rss_bytes"})
DEFAULT_MIN_EFFECT = 0.03
PRESETS: dict[str, dict[str, float]] = {
    "default": {"quality": 0.5, "latency": 0.2, "throughput": 0.2, "memory": 0.1},
    "chat": {"quality": 0.4, "latency": 0.4, "throughput": 0.1, "memory": 0.1},
    "batch": {"quality": 0.35, "latency": 0.05, "throughput": 0.45, "memory": 0.15},
    "quality-critical": {"quality": 0.8, "latency": 0.1, "throughput": 0.05, "memory": 0.05},
}


@dataclass(frozen=True)
class Gates:
    """Disqualify a variant before scoring."""

    min_quality_share: float = 0.9  # quality relative to the base model
    max_repetition: float = 0.5  # share of repeated 4-grams in golden-prompt outputs
    min_printable: float = 0.95  # share of printable characters in golden-prompt outputs


@dataclass
class VariantMeasurement:
    """What `select` measured for one variant (None: could not be measured). An absent
    interval means the number is exact; `quality_replicates` are the quality shares on the
    bootstrap resamples shared by all variants (paired), absent when quality is exact."""

    variant: str
    metrics: dict[str, float] = field(default_factory=dict)
    noise: dict[str, float] = field(default_factory=dict)  # metric -> 95% half-width; 0 absent
    load_error: str | None = None
    repetition: float = 0.0
    printable: float = 1.0
    quality_interval: Interval | None = None
    quality_replicates: np.ndarray | None = None
    repetition_interval: Interval | None = None
    printable_interval: Interval | None = None


@dataclass
class VariantScore:
    variant: str
    passed: bool
    reasons: list[str]  # why it was gated out (empty if it passed)
    normalized: dict[str, float]  # metric -> 0..1
    group_scores: dict[str, float]  # group -> 0..1
    score: float
    warnings: list[str] = field(default_factory=list)  # gates its interval straddles


@dataclass(frozen=True)
class GateResult:
    """Why a variant is gated out (`reasons`, empty: it passes) and which gates it passed
    only because the interval straddles them (`warnings`)."""

    reasons: list[str]
    warnings: list[str]


@dataclass(frozen=True)
class Ranking:
    """One selection's outcome, as the report and the provenance record describe it:
    scores best first, the evaluations they came from, and the rules that applied."""

    scores: list[VariantScore]
    evaluations: dict[str, dict[str, Any]]
    weights: dict[str, float]
    gates: Gates
    min_effect: float = DEFAULT_MIN_EFFECT
    bootstrap: dict[str, Any] = field(default_factory=dict)  # how quality intervals were drawn

    @property
    def winner(self) -> VariantScore:
        return self.scores[0]


def weights_for(preset: str | None, overrides: dict[str, float] | None = None) -> dict[str, float]:
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    weights = dict(PRESETS[preset or "default"])
    weights.update(overrides or {})
    unknown = set(weights) - {group for group, _ in METRICS.values()}
    if unknown:
        raise ValueError(f"unknown weight groups: {', '.join(sorted(unknown))}")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError("weights must be non-negative and not all zero")
    total = sum(weights.values())
    return {group: w / total for group, w in weights.items()}


def _percent(value: float, interval: Interval | None) -> str:
    if interval is None:
        return f"{value:.1%}"
    return f"{value:.1%} (95% interval {interval.low:.1%}..{interval.high:.1%})"


def gate(measurement: VariantMeasurement, gates: Gates) -> GateResult:
    """Check every gate: a gate fails when the whole interval (or the exact value) is on the
    wrong side of it, and warns when the interval straddles it."""
    if measurement.load_error is not None:
        return GateResult([f"failed to load: {measurement.load_error}"], [])
    reasons: list[str] = []
    warnings: list[str] = []
    m = measurement
    quality = m.metrics.get("quality")
    if quality is None:
        reasons.append(f"quality unmeasured, below the {gates.min_quality_share:.0%} gate")
    else:
        shown = _percent(quality, m.quality_interval)
        interval = m.quality_interval or Interval.exact(quality)
        if interval.high < gates.min_quality_share:
            reasons.append(
                f"quality {shown} of the base, below the {gates.min_quality_share:.0%} gate"
            )
        elif interval.low < gates.min_quality_share:
            warnings.append(
                f"quality {shown} of the base straddles the {gates.min_quality_share:.0%} "
                "gate: passed, as the interval does not lie below it"
            )
    interval = m.repetition_interval or Interval.exact(m.repetition)
    text = f"{_percent(m.repetition, m.repetition_interval)} repeated 4-grams"
    text += " over all golden prompts"
    if interval.low > gates.max_repetition:
        reasons.append(f"degenerate output: {text} (gate {gates.max_repetition:.0%})")
    elif interval.high > gates.max_repetition:
        warnings.append(f"{text} straddles the {gates.max_repetition:.0%} degeneration gate")
    interval = m.printable_interval or Interval.exact(m.printable)
    text = f"{_percent(m.printable, m.printable_interval)} printable characters on golden prompts"
    if interval.high < gates.min_printable:
        reasons.append(f"non-text output: {text} (gate {gates.min_printable:.0%})")
    elif interval.low < gates.min_printable:
        warnings.append(f"{text} straddles the {gates.min_printable:.0%} gate")
    return GateResult(reasons, warnings)


def normalize(values: dict[str, float], higher_is_better: bool) -> dict[str, float]:
    lo, hi = min(values.values()), max(values.values())
    if hi == lo:
        return dict.fromkeys(values, 1.0)
    scaled = {name: (value - lo) / (hi - lo) for name, value in values.items()}
    return scaled if higher_is_better else {name: 1.0 - s for name, s in scaled.items()}


def tie_leaders(
    values: dict[str, float],
    higher_is_better: bool,
    differs: Callable[[str, str], bool],
) -> dict[str, str]:
    """variant -> the best variant of its tie group: from the best value down, a variant
    that does not differ from the current leader (`differs(leader, variant)`) joins its
    group, else leads a new one."""
    leaders: dict[str, str] = {}
    leader = None
    for name in sorted(values, key=lambda n: (values[n], n), reverse=higher_is_better):
        if leader is None or differs(leader, name):
            leader = name
        leaders[name] = leader
    return leaders


def serving_differs(
    values: dict[str, float], noise: dict[str, float], min_effect: float
) -> Callable[[str, str], bool]:
    """Whether two variants' values of one serving metric differ (`stats.differ`)."""

    def differs(a: str, b: str) -> bool:
        return differ(values[a], noise[a], values[b], noise[b], min_effect)

    return differs


def quality_differs(a: VariantMeasurement, b: VariantMeasurement) -> bool:
    """Whether two variants' quality shares differ: the paired bootstrap interval of the
    difference excludes zero; without replicates (exact numbers), whether they are unequal."""
    if a.quality_replicates is None or b.quality_replicates is None:
        return a.metrics["quality"] != b.metrics["quality"]
    return paired_difference(a.quality_replicates, b.quality_replicates).excludes(0.0)


def score_variants(
    measurements: list[VariantMeasurement],
    weights: dict[str, float],
    gates: Gates,
    min_effect: float = DEFAULT_MIN_EFFECT,
) -> list[VariantScore]:
    """Gate, normalize and weight; returns scores sorted best first (failed ones last)."""
    results = {m.variant: gate(m, gates) for m in measurements}
    survivors = [m for m in measurements if not results[m.variant].reasons]
    by_name = {m.variant: m for m in survivors}
    normalized: dict[str, dict[str, float]] = {m.variant: {} for m in measurements}
    for metric, (_, higher_is_better) in METRICS.items():
        values = {m.variant: m.metrics[metric] for m in survivors if metric in m.metrics}
        if not values:
            continue
        if metric == "quality":
            span = max(1.0 - gates.min_quality_share, 1e-9)
            scaled = {
                variant: min(max((value - gates.min_quality_share) / span, 0.0), 1.0)
                for variant, value in values.items()
            }
            leaders = tie_leaders(
                values, True, lambda a, b: quality_differs(by_name[a], by_name[b])
            )
        else:
            noise = {name: by_name[name].noise.get(metric, 0.0) for name in values}
            effect = min_effect if metric in NOISY_METRICS else 0.0
            leaders = tie_leaders(values, higher_is_better, serving_differs(values, noise, effect))
            scaled = normalize(values, higher_is_better)
        for variant in values:
            normalized[variant][metric] = scaled[leaders[variant]]
    scores = []
    for m in measurements:
        groups: dict[str, list[float]] = {}
        for metric, value in normalized[m.variant].items():
            groups.setdefault(METRICS[metric][0], []).append(value)
        group_scores = {group: sum(v) / len(v) for group, v in groups.items()}
        result = results[m.variant]
        passed = not result.reasons
        total = sum(weights.get(g, 0.0) * s for g, s in group_scores.items()) if passed else 0.0
        scores.append(
            VariantScore(m.variant, passed, result.reasons, normalized[m.variant],
                         group_scores, total, result.warnings)
        )  # fmt: skip
    by_weight = sorted(weights, key=lambda g: (-weights[g], g))
    return sorted(
        scores,
        key=lambda s: (
            not s.passed,
            -round(s.score, 9),
            *(-round(s.group_scores.get(g, 0.0), 9) for g in by_weight),
            s.variant,
        ),
    )


def tie_at_top(scores: list[VariantScore], weights: dict[str, float]) -> tuple[list[str], str]:
    """([winner, variants tied with it on score], what decided between them) where the top
    scores are equal; ([], "") otherwise. What decided: the highest-weighted group where
    the winner scored higher, or "name" when they are equal everywhere."""
    winner = scores[0]
    if not winner.passed:
        return [], ""
    tied = [
        s.variant for s in scores[1:] if s.passed and round(s.score, 9) == round(winner.score, 9)
    ]
    if not tied:
        return [], ""
    runner_up = next(s for s in scores if s.variant == tied[0])
    for group in sorted(weights, key=lambda g: (-weights[g], g)):
        if round(winner.group_scores.get(group, 0.0), 9) > round(
            runner_up.group_scores.get(group, 0.0), 9
        ):
            return [winner.variant, *tied], group
    return [winner.variant, *tied], "name"
