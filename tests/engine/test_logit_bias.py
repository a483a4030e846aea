"""`logit_bias` in the sampler, against a plain-torch reference, and its parameter checks."""

from __future__ import annotations

import pickle

import pytest
import torch

from modelship.engine.sampler import SamplingMetadata, sample
from modelship.engine.sampling_params import InvalidParamsError, SamplingParams

VOCAB = 50


def meta(params: list[SamplingParams], outputs=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params, [[1, 2]] * n, outputs or [[] for _ in range(n)], [None] * n, VOCAB, "cpu"
    )


def ref_biased(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    out = logits.clone()
    for token_id, value in bias.items():
        out[token_id] += value
    return out


def test_bias_is_added_before_penalties_and_logprobs_see_it() -> None:
    logits = torch.randn(3, VOCAB)
    biases = [{7: 100.0}, {int(logits[1].argmax()): -100.0, 3: 2.5}, {}]
    params = [SamplingParams(temperature=0, logprobs=2, logit_bias=b or None) for b in biases]
    out = sample(logits.clone(), meta(params))
    reference = torch.stack([ref_biased(logits[i], b) for i, b in enumerate(biases)])
    assert torch.equal(out.token_ids, reference.argmax(-1))
    assert out.token_ids[0] == 7  # +100 forces it
    assert out.token_ids[1] != logits[1].argmax()  # -100 bans the favourite
    torch.testing.assert_close(out.logprobs, reference.log_softmax(-1).max(-1).values)

    # with a repetition penalty the bias comes first: a seen token's biased logit is divided
    penalized = SamplingParams(temperature=0, logprobs=0, logit_bias={5: 3.0},
                               repetition_penalty=2.0)  # fmt: skip
    row = torch.zeros(1, VOCAB)
    got = sample(row.clone(), meta([penalized], outputs=[[5]]))
    assert got.logprobs[0] == pytest.approx(1.5 - torch.logsumexp(
        torch.tensor([1.5] + [0.0] * (VOCAB - 1)), 0).item())  # fmt: skip


def test_bias_forces_and_bans_under_sampling_with_n_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    forced = SamplingParams(temperature=1.0, top_p=0.9, logit_bias={11: 100.0})
    banned = SamplingParams(temperature=1.5, logit_bias={t: -100.0 for t in range(VOCAB - 1)})
    for _ in range(20):
        out = sample(logits.clone(), meta([forced, forced, banned, banned]))
        assert out.token_ids.tolist() == [11, 11, VOCAB - 1, VOCAB - 1]


def test_caller_logits_are_left_alone() -> None:
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    sample(logits, meta([SamplingParams(temperature=0, logit_bias={1: 50})]))
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "bias",
    [
        {i: 1.0 for i in range(301)},
        {1: 100.5},
        {1: -101},
        {1: float("nan")},
        {1: True},
        {-1: 1.0},
        {"1": 1.0},
        [1, 2],
    ],
)
def test_out_of_range_logit_bias_is_refused(bias) -> None:
    with pytest.raises(InvalidParamsError) as caught:
        SamplingParams(logit_bias=bias)
    assert caught.value.param == "logit_bias"


def test_token_outside_the_vocabulary_is_refused_and_params_pickle() -> None:
    params = SamplingParams(logit_bias={i: -100 for i in range(300)})
    params.verify(300)
    assert pickle.loads(pickle.dumps(params)).logit_bias == params.logit_bias  # the core pipe
    with pytest.raises(InvalidParamsError, match="token id 300"):
        SamplingParams(logit_bias={300: 1.0}).verify(300)
