"""Selection scoring: gates first, min-max normalization, weighted groups, presets."""

from __future__ import annotations

import pytest

from modelship.pipeline.select.scoring import (
    Gates,
    VariantMeasurement,
    normalize,
    score_variants,
    weights_for,
)


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
