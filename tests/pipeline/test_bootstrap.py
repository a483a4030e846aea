"""The paired bootstrap and select's item-based intervals: reproducible draws, percentile
intervals, paired differences far narrower than the marginal intervals, and quality shares
and degeneration pooled over items."""

from __future__ import annotations

import numpy as np
import pytest

from modelship.pipeline.select.bootstrap import (
    Interval,
    Resampler,
    identity,
    mean_over,
    paired_difference,
    percentile_interval,
    ratio_over,
)
from modelship.pipeline.select.intervals import estimate


def test_draws_are_seeded_per_pool_and_shared_by_equal_arguments() -> None:
    a, b = Resampler(500, seed=3), Resampler(500, seed=3)
    assert np.array_equal(a.indices("tasks", 60), b.indices("tasks", 60))
    assert not np.array_equal(a.indices("tasks", 60), a.indices("passages", 60))
    assert not np.array_equal(a.indices("tasks", 60), Resampler(500, seed=4).indices("tasks", 60))
    drawn = a.indices("tasks", 60)
    assert drawn.shape == (500, 60) and drawn.min() >= 0 and drawn.max() == 59
    with pytest.raises(ValueError, match="no items"):
        a.indices("tools", 0)


def test_percentile_interval_and_pooled_ratios() -> None:
    interval = percentile_interval(np.arange(1, 1001))
    assert interval.low in (25.0, 26.0) and interval.high == 975.0  # order statistics
    # order statistics: an infinite replicate (a broken model's perplexity) stays defined
    assert percentile_interval(np.array([1.0] * 99 + [np.inf])).high == 1.0
    assert mean_over([1, 0, 1, 1], identity(4))[0] == 0.75
    # pooled: 30 of 40 tokens, not the mean of 1/10 and 29/30
    assert ratio_over([1, 29], [10, 30], identity(2))[0] == 30 / 40
    assert ratio_over([0], [0], identity(1))[0] == 0.0


def test_a_paired_difference_is_narrower_than_the_marginal_intervals() -> None:
    rng = np.random.default_rng(0)
    hard = rng.random(200) < 0.5  # items both variants get wrong or right together
    a = hard.astype(float)
    b = a.copy()
    b[:6] = 1 - b[:6]  # b differs from a on 6 of 200 items
    at = Resampler(2000).indices("tasks", 200)
    ra, rb = mean_over(a, at), mean_over(b, at)
    marginal = percentile_interval(ra)
    difference = paired_difference(ra, rb)
    assert marginal.high - marginal.low > 0.1
    assert difference.high - difference.low < 0.06
    assert paired_difference(ra, ra) == Interval(0.0, 0.0)
    with pytest.raises(ValueError, match="unpaired"):
        paired_difference(ra, rb[:10])


def evaluation(name: str, tasks: list[bool], nll: list[float], checks=None) -> dict:
    items = {
        "passage_nll": nll,
        "passage_tokens": [100] * len(nll),
        "passage_agree": [90] * len(nll),
        "passage_kl": [1.0] * len(nll),
        "task_correct": tasks,
        "tool_correct": [True, False] * 5,
    }
    quality = {"items": items}
    serving = {"golden_checks": checks} if checks else None
    return {"variant": name, "quality": quality, "serving": serving}


def test_estimates_are_paired_and_identical_variants_differ_by_exactly_zero() -> None:
    tasks = [i % 3 != 0 for i in range(60)]
    nll = [200.0, 210.0, 190.0, 205.0]
    evaluations = {
        "base": evaluation("base", tasks, nll),
        "a": evaluation("a", tasks, nll),
        "b": evaluation("b", tasks, nll),
        "worse": evaluation("worse", [False] * 10 + tasks[10:], [n * 1.1 for n in nll]),
    }
    out = estimate(evaluations, "base", Resampler(1000))
    assert out["a"].share.value == 1.0 and out["a"].share.interval == Interval(1.0, 1.0)
    assert out["a"].difference(out["b"]).interval == Interval(0.0, 0.0)
    assert out["a"].quality["perplexity"].value == pytest.approx(np.exp(805 / 400))
    worse = out["worse"]
    # tasks: 34/40 kept, cross-entropy 1/1.1, tools kept: the mean of the three retentions
    expected = (34 / 40 + 1 / 1.1 + 1.0) / 3
    assert worse.share.value == pytest.approx(expected)
    assert worse.share.interval.low < expected < worse.share.interval.high
    assert worse.difference(out["a"]).interval.high < 0  # a real loss, paired
    again = estimate(evaluations, "base", Resampler(1000))
    assert again["worse"].share == worse.share  # seeded: the same report twice
    evaluations["short"] = evaluation("short", tasks[:50], nll)
    with pytest.raises(ValueError, match="short was measured on other items"):
        estimate(evaluations, "base", Resampler(100))


def test_degeneration_is_pooled_over_all_golden_prompts() -> None:
    tasks, nll = [True] * 10, [100.0]
    looping = {"repeated_ngrams": 25, "ngrams": 45, "printable_chars": 50, "chars": 50}
    clean = {"repeated_ngrams": 0, "ngrams": 45, "printable_chars": 50, "chars": 50}
    evaluations = {
        "base": evaluation("base", tasks, nll),
        "awq": evaluation("awq", tasks, nll, [looping, clean, clean, clean]),
    }
    repetition = estimate(evaluations, "base", Resampler(1000))["awq"].repetition
    assert repetition.value == pytest.approx(25 / 180)  # one loop of four answers, pooled
    assert repetition.interval.low == 0.0 and 0.3 < repetition.interval.high < 25 / 45


def test_the_multiple_choice_set_joins_the_quality_share_paired() -> None:
    tasks = [i % 3 != 0 for i in range(60)]
    nll = [200.0, 210.0, 190.0, 205.0]
    base_norm = [i % 2 == 0 for i in range(400)]  # 200 of 400 right
    worse_norm = [False] * 40 + base_norm[40:]  # 20 of them lost
    evaluations = {}
    for name, norm in (("base", base_norm), ("same", base_norm), ("worse", worse_norm)):
        evaluations[name] = evaluation(name, tasks, nll)
        evaluations[name]["quality"]["items"] |= {
            "benchmark_correct": norm,
            "benchmark_correct_norm": norm,
            "benchmark_choice_prob": [0.7 if ok else 0.2 for ok in norm],
        }
    out = estimate(evaluations, "base", Resampler(1000))
    assert out["same"].share.value == 1.0
    # tasks, cross-entropy and tools kept; acc_norm 180/200: the mean of four retentions
    assert out["worse"].share.value == pytest.approx((3 + 180 / 200) / 4)
    assert out["worse"].quality["benchmark_acc_norm"].value == pytest.approx(180 / 400)
    assert out["worse"].quality["benchmark_choice_prob"].value == pytest.approx(
        (180 * 0.7 + 220 * 0.2) / 400
    )
    assert out["worse"].difference(out["same"]).interval.high < 0
