"""Every numeric field of `SamplingParams` is bounded; a bad one names itself."""

from __future__ import annotations

import math

import pytest
import torch

from modelship.engine import InvalidParamsError, SamplingParams
from modelship.engine.sampling_params import SEED_MAX, SEED_MIN


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("temperature", -0.5),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 3.0),
        ("min_p", math.inf),
        ("seed", SEED_MAX + 1),
        ("seed", SEED_MIN - 1),
        ("seed", 2**64),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("repetition_penalty", math.nan),
        ("frequency_penalty", math.nan),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -math.inf),
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("stop", [1]),
        ("stop_token_ids", ["x"]),
    ],
)
def test_out_of_range_field_is_rejected_by_name(field: str, value: object) -> None:
    with pytest.raises(InvalidParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_verify_bounds_top_k_and_logprobs_by_the_vocab_and_rechecks_fields() -> None:
    SamplingParams(top_k=50, logprobs=20).verify(vocab_size=50)
    for field, value in [("top_k", 51), ("top_k", 2**63), ("logprobs", 5), ("prompt_logprobs", 5)]:
        with pytest.raises(InvalidParamsError) as info:
            SamplingParams(**{field: value}).verify(vocab_size=4 if "logprobs" in field else 50)
        assert info.value.param == field
    params = SamplingParams(seed=1)
    params.seed = 2**64  # changed after construction: still caught before it reaches torch
    with pytest.raises(InvalidParamsError, match="seed"):
        params.verify(vocab_size=50)


def test_seed_bounds_fit_torch_generators_for_every_sibling() -> None:
    for seed in (SEED_MIN, SEED_MAX):
        params = SamplingParams(seed=seed, n=16)
        for index in range(params.n):
            torch.Generator().manual_seed(params.seed + index)


def test_tiny_temperatures_are_greedy() -> None:
    assert SamplingParams(temperature=1e-9).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy
