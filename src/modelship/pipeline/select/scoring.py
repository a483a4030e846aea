"""Scoring variants: hard gates first, then metrics normalized to 0..1 and weighted.

Pure functions over measured numbers, so the choice can be tested and explained exactly.
Quality is a share of the base model's quality and is scored on a fixed scale anchored at
the quality gate: the gate scores 0, the base's quality 1 (min-max would turn any
small loss into a full point lost, however small). The other metrics are
normalized min-max across the variants that passed the gates; for metrics where lower is
better (latency, memory) the scale is flipped. With a single survivor, or when all
survivors measure the same, every survivor scores 1 on that metric.

Serving metrics carry noise (95% half-widths from repeated rounds, `stats`). Variants whose
values do not differ (`stats.differ`) from the best of their group score the same: walking
from the best value down, each variant scores as the leader of its tie group. So a variant
cannot win on a difference inside the noise, and two copies of the same weights tie. When
the top scores are equal, the ranking falls to the groups in order of weight (quality first
by default), then to the variant name, and `tie_at_top` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    """What `select` measured for one variant (None: could not be measured)."""

    variant: str
    metrics: dict[str, float] = field(default_factory=dict)
    noise: dict[str, float] = field(default_factory=dict)  # metric -> 95% half-width; 0 absent
    load_error: str | None = None
    repetition: float = 0.0
    printable: float = 1.0


@dataclass
class VariantScore:
    variant: str
    passed: bool
    reasons: list[str]  # why it was gated out (empty if it passed)
    normalized: dict[str, float]  # metric -> 0..1
    group_scores: dict[str, float]  # group -> 0..1
    score: float


@dataclass(frozen=True)
class Ranking:
    """One selection's outcome, as the report and the provenance record describe it:
    scores best first, the evaluations they came from, and the rules that applied."""

    scores: list[VariantScore]
    evaluations: dict[str, dict[str, Any]]
    weights: dict[str, float]
    gates: Gates
    min_effect: float = DEFAULT_MIN_EFFECT

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


def gate(measurement: VariantMeasurement, gates: Gates) -> list[str]:
    """The reasons a variant is disqualified (empty list: it passes)."""
    if measurement.load_error is not None:
        return [f"failed to load: {measurement.load_error}"]
    reasons = []
    quality = measurement.metrics.get("quality")
    if quality is None or quality < gates.min_quality_share:
        shown = "unmeasured" if quality is None else f"{quality:.1%}"
        reasons.append(f"quality {shown} of the base, below the {gates.min_quality_share:.0%} gate")
    if measurement.repetition > gates.max_repetition:
        reasons.append(
            f"degenerate output on golden prompts: {measurement.repetition:.0%} repeated "
            f"4-grams (gate {gates.max_repetition:.0%})"
        )
    if measurement.printable < gates.min_printable:
        reasons.append(
            f"non-text output on golden prompts: {measurement.printable:.0%} printable "
            f"characters (gate {gates.min_printable:.0%})"
        )
    return reasons


def normalize(values: dict[str, float], higher_is_better: bool) -> dict[str, float]:
    lo, hi = min(values.values()), max(values.values())
    if hi == lo:
        return dict.fromkeys(values, 1.0)
    scaled = {name: (value - lo) / (hi - lo) for name, value in values.items()}
    return scaled if higher_is_better else {name: 1.0 - s for name, s in scaled.items()}


def tie_leaders(
    values: dict[str, float],
    noise: dict[str, float],
    higher_is_better: bool,
    min_effect: float,
) -> dict[str, str]:
    """variant -> the best variant of its tie group: from the best value down, a variant
    that does not differ from the current leader joins its group, else leads a new one."""
    leaders: dict[str, str] = {}
    leader = None
    for name in sorted(values, key=lambda n: (values[n], n), reverse=higher_is_better):
        if leader is None or differ(
            values[leader], noise[leader], values[name], noise[name], min_effect
        ):
            leader = name
        leaders[name] = leader
    return leaders


def score_variants(
    measurements: list[VariantMeasurement],
    weights: dict[str, float],
    gates: Gates,
    min_effect: float = DEFAULT_MIN_EFFECT,
) -> list[VariantScore]:
    """Gate, normalize and weight; returns scores sorted best first (failed ones last)."""
    reasons = {m.variant: gate(m, gates) for m in measurements}
    survivors = [m for m in measurements if not reasons[m.variant]]
    normalized: dict[str, dict[str, float]] = {m.variant: {} for m in measurements}
    for metric, (_, higher_is_better) in METRICS.items():
        values = {m.variant: m.metrics[metric] for m in survivors if metric in m.metrics}
        if metric == "quality":
            span = max(1.0 - gates.min_quality_share, 1e-9)
            for variant, value in values.items():
                share = (value - gates.min_quality_share) / span
                normalized[variant][metric] = min(max(share, 0.0), 1.0)
        elif values:
            noise = {m.variant: m.noise.get(metric, 0.0) for m in survivors if m.variant in values}
            effect = min_effect if metric in NOISY_METRICS else 0.0
            leaders = tie_leaders(values, noise, higher_is_better, effect)
            scaled = normalize(values, higher_is_better)
            for variant in values:
                normalized[variant][metric] = scaled[leaders[variant]]
    scores = []
    for m in measurements:
        groups: dict[str, list[float]] = {}
        for metric, value in normalized[m.variant].items():
            groups.setdefault(METRICS[metric][0], []).append(value)
        group_scores = {group: sum(v) / len(v) for group, v in groups.items()}
        passed = not reasons[m.variant]
        total = sum(weights.get(g, 0.0) * s for g, s in group_scores.items()) if passed else 0.0
        scores.append(
            VariantScore(m.variant, passed, reasons[m.variant], normalized[m.variant],
                         group_scores, total)
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
