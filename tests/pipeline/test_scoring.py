"""Selection scoring: gates first, min-max normalization, weighted groups, presets."""

from __future__ import annotations

import numpy as np
import pytest

from modelship.pipeline.select.bootstrap import Interval
from modelship.pipeline.select.report import explain
from modelship.pipeline.select.scoring import (
    Gates,
    VariantMeasurement,
    normalize,
    score_variants,
    tie_at_top,
    weights_for,
)
from modelship.pipeline.select.stats import Estimate, differ


def measured(name: str, quality: float, ttft: float, tput: float, mem: float, **kw):
    metrics = {"quality": quality, "ttft_s": ttft, "throughput_tok_s": tput, "weight_bytes": mem}
    return VariantMeasurement(name, metrics, **kw)


def test_normalize_flips_lower_is_better() -> None:
    assert normalize({"a": 1.0, "b": 3.0}, higher_is_better=True) == {"a": 0.0, "b": 1.0}
    assert normalize({"a": 1.0, "b": 3.0}, higher_is_better=False) == {"a": 1.0, "b": 0.0}
    assert normalize({"a": 2.0, "b": 2.0}, higher_is_better=False) == {"a": 1.0, "b": 1.0}


def test_gates_disqualify_with_reasons() -> None:
    variants = [
        measured("fp16", 1.0, 0.2, 30, 270e6),
        measured("gptq", 0.97, 0.1, 40, 100e6),
        measured("broken", 0.5, 0.1, 50, 90e6),
        measured("loops", 0.95, 0.1, 45, 95e6, repetition=0.9),
        VariantMeasurement("missing", load_error="config.json not found"),
    ]
    scores = score_variants(variants, weights_for(None), Gates())
    by_name = {s.variant: s for s in scores}
    assert [s.variant for s in scores[:2]] == ["gptq", "fp16"]
    assert "below the 90% gate" in by_name["broken"].reasons[0]
    assert "repeated 4-grams" in by_name["loops"].reasons[0]
    assert by_name["missing"].reasons == ["failed to load: config.json not found"]
    assert all(not by_name[n].passed and by_name[n].score == 0 for n in ("broken", "missing"))
    # the broken variant is fastest but does not shift the survivors' normalization
    assert by_name["gptq"].normalized["throughput_tok_s"] == 1.0


def test_presets_change_the_winner() -> None:
    variants = [measured("fp16", 1.0, 0.3, 20, 270e6), measured("gptq", 0.92, 0.1, 40, 100e6)]
    assert score_variants(variants, weights_for("quality-critical"), Gates())[0].variant == "fp16"
    assert score_variants(variants, weights_for("batch"), Gates())[0].variant == "gptq"
    weights = weights_for("chat", {"memory": 0.0})
    assert abs(sum(weights.values()) - 1.0) < 1e-9 and weights["memory"] == 0.0


def test_bad_weights_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        weights_for("fastest")
    with pytest.raises(ValueError, match="unknown weight groups: speed"):
        weights_for(None, {"speed": 1.0})


def noisy(name: str, quality: float, ttft: float, tput: float, noise: float) -> VariantMeasurement:
    """A variant measured in rounds: each serving metric with a 95% half-width of `noise`
    times its value."""
    m = measured(name, quality, ttft, tput, 100e6)
    m.noise = {"ttft_s": ttft * noise, "throughput_tok_s": tput * noise}
    return m


def test_differences_inside_the_noise_are_ties_broken_by_quality() -> None:
    # b is 6% faster by its means, but the intervals (+/-5% each) overlap: no latency win
    a, b = noisy("a", 0.99, 0.100, 40.0, 0.05), noisy("b", 0.98, 0.094, 42.4, 0.05)
    scores = score_variants([b, a], weights_for(None), Gates())
    by_name = {s.variant: s for s in scores}
    assert by_name["a"].normalized["ttft_s"] == by_name["b"].normalized["ttft_s"] == 1.0
    assert by_name["a"].normalized["throughput_tok_s"] == 1.0
    assert scores[0].variant == "a"  # won on quality, the only real difference
    assert tie_at_top(scores, weights_for(None)) == ([], "")


def test_identical_variants_tie_and_the_report_says_so() -> None:
    twins = [noisy("b-twin", 0.99, 0.1002, 40.1, 0.04), noisy("a-twin", 0.99, 0.0998, 39.9, 0.04)]
    scores = score_variants(twins, weights_for(None), Gates())
    assert scores[0].score == scores[1].score
    assert scores[0].normalized == scores[1].normalized  # never a win on latency
    assert tie_at_top(scores, weights_for(None)) == (["a-twin", "b-twin"], "name")
    assert "Tie within noise: **a-twin** and **b-twin**" in explain(scores, weights_for(None))[1]


def test_a_difference_beyond_the_noise_and_the_minimum_effect_counts() -> None:
    fast, slow = noisy("fast", 0.99, 0.050, 80.0, 0.02), noisy("slow", 0.99, 0.100, 40.0, 0.02)
    scores = score_variants([slow, fast], weights_for(None), Gates())
    assert [s.variant for s in scores] == ["fast", "slow"]
    assert scores[1].normalized["ttft_s"] == 0.0
    # exact (noise-free) 2% apart: under a 3% minimum effect a tie, at 1% a difference
    close = [measured("x", 0.99, 0.100, 40, 1e8), measured("y", 0.99, 0.102, 40, 1e8)]
    for m in close:
        m.noise = {"ttft_s": 0.0}
    tied = score_variants(close, weights_for(None), Gates(), min_effect=0.03)
    assert tied[0].normalized["ttft_s"] == tied[1].normalized["ttft_s"]
    split = score_variants(close, weights_for(None), Gates(), min_effect=0.01)
    assert [s.variant for s in split] == ["x", "y"] and split[1].normalized["ttft_s"] == 0.0


def test_confidence_intervals_of_repeated_samples() -> None:
    estimate = Estimate.of([10.0, 12.0, 11.0, 13.0, 9.0])
    assert estimate.mean == 11.0 and estimate.n == 5
    # stdev 1.581, sem 0.707, t(4) = 2.776
    assert abs(estimate.half_width - 2.776 * 1.5811 / 5**0.5) < 1e-3
    assert Estimate.of([5.0]).half_width == float("inf")
    assert not differ(10.0, 1.0, 11.5, 1.0, 0.0) and differ(10.0, 1.0, 12.5, 1.0, 0.0)
    with pytest.raises(ValueError, match="no samples"):
        Estimate.of([])


def bootstrapped(name: str, quality: float, replicates, low: float, high: float):
    """A variant whose quality share came with paired bootstrap replicates."""
    m = measured(name, quality, 0.1, 40.0, 100e6)
    m.quality_replicates = np.asarray(replicates)
    m.quality_interval = Interval(low, high)
    return m


def test_quality_inside_the_paired_interval_is_a_tie_like_serving_metrics() -> None:
    rng = np.random.default_rng(1)
    shared = rng.normal(0.0, 0.02, 2000)  # what both variants get right or wrong together
    a = bootstrapped("a", 0.975, 0.975 + shared + rng.normal(0, 0.01, 2000), 0.93, 1.0)
    b = bootstrapped("b", 0.965, 0.965 + shared + rng.normal(0, 0.01, 2000), 0.92, 1.0)
    scores = score_variants([b, a], weights_for(None), Gates())
    assert scores[0].normalized["quality"] == scores[1].normalized["quality"]
    assert scores[0].normalized["quality"] == pytest.approx(0.75)  # a's, the leader's
    assert tie_at_top(scores, weights_for(None)) == (["a", "b"], "name")
    # the same two means with a paired difference that is never zero: a real difference
    a.quality_replicates = 0.975 + shared
    b.quality_replicates = 0.965 + shared
    by_name = {s.variant: s for s in score_variants([b, a], weights_for(None), Gates())}
    assert by_name["a"].normalized["quality"] == pytest.approx(0.75)
    assert by_name["b"].normalized["quality"] == pytest.approx(0.65)


def test_a_quality_interval_that_straddles_the_gate_passes_with_a_warning() -> None:
    on_gate = bootstrapped("on-gate", 0.895, [0.895], 0.85, 0.94)
    below = bootstrapped("below", 0.86, [0.86], 0.80, 0.89)
    safe = bootstrapped("safe", 0.97, [0.97], 0.95, 0.99)
    scores = score_variants([on_gate, below, safe], weights_for(None), Gates())
    by_name = {s.variant: s for s in scores}
    assert by_name["on-gate"].passed and not by_name["on-gate"].reasons
    [warning] = by_name["on-gate"].warnings
    assert "89.5% (95% interval 85.0%..94.0%)" in warning and "straddles the 90% gate" in warning
    assert not by_name["below"].passed
    assert (
        "(95% interval 80.0%..89.0%) of the base, below the 90% gate" in by_name["below"].reasons[0]
    )
    assert by_name["safe"].passed and by_name["safe"].warnings == []
    lines = explain(scores, weights_for(None))
    assert any(
        line.startswith("**on-gate** passed with a warning: quality 89.5%") for line in lines
    )


def test_degeneration_gates_read_the_interval_over_all_golden_prompts() -> None:
    m = measured("awq", 0.97, 0.1, 40.0, 1e8, repetition=0.14)
    m.repetition_interval = Interval(0.0, 0.56)  # one looping prompt of four
    result = score_variants([m], weights_for(None), Gates())[0]
    assert result.passed and "straddles the 50% degeneration gate" in result.warnings[0]
    m.repetition, m.repetition_interval = 0.7, Interval(0.55, 0.9)
    result = score_variants([m], weights_for(None), Gates())[0]
    assert not result.passed and "degenerate output: 70.0%" in result.reasons[0]
