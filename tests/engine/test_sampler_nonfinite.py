"""Logits with no distribution in them (NaN, +inf, all -inf) fail their request with a
clear error instead of yielding a token: the rollout drill's NaN-weight canary used to
answer 200 with five copies of token 0, which no judge could tell from a real answer. The
other rows of the batch sample as usual, and a client's extreme penalty is never taken for
a broken model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelship.engine.llm import LLM
from modelship.engine.sampler import SamplingMetadata, sample
from modelship.engine.sampling_params import SamplingParams

VOCAB = 32


def meta(params: list[SamplingParams]) -> SamplingMetadata:
    n = len(params)
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    return SamplingMetadata.build(params, [[1, 2]] * n, [[3]] * n, generators, VOCAB, "cpu")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=5),
        SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=2),
    ],
    ids=["greedy", "random", "penalties+logprobs"],
)
def test_a_nonfinite_row_is_named_not_sampled(bad: float, params: SamplingParams) -> None:
    logits = torch.randn(3, VOCAB)
    expected = sample(logits.clone(), meta([params] * 3)).token_ids
    logits[1, 7] = bad
    out = sample(logits, meta([params] * 3))
    assert out.nonfinite_rows == [1]
    assert out.token_ids[[0, 2]].tolist() == expected[[0, 2]].tolist()  # the others sample


def test_an_all_minus_inf_row_is_refused_and_finite_rows_still_sample() -> None:
    logits = torch.randn(2, VOCAB)
    logits[0] = float("-inf")
    assert sample(logits, meta([SamplingParams(temperature=0)] * 2)).nonfinite_rows == [0]
    logits[0, 3] = 1.0  # one finite logit is a distribution (all mass on it)
    out = sample(logits, meta([SamplingParams(temperature=0)] * 2))
    assert out.token_ids[0] == 3


@pytest.mark.parametrize("penalty", [1e-300, 1e-30, 1e30, 1e308])
def test_an_extreme_penalty_is_a_clients_choice_not_a_broken_model(penalty: float) -> None:
    """Only the model's own logits are checked: a repetition penalty that overflows a
    logit (the API bounds it to [0.01, 100]; the sampler must cope anyway) still samples,
    with finite logprobs, and no row is taken for a broken model."""
    logits = torch.randn(2, VOCAB)
    logits[:, 1] = 5.0  # a seen token with a positive logit: divided by the penalty
    params = SamplingParams(temperature=0, logprobs=2)
    params.repetition_penalty = penalty  # past the API's bounds: the sampler must cope
    out = sample(logits, meta([params, SamplingParams(temperature=0.7, seed=3)]))
    assert out.token_ids.shape == (2,)
    assert out.logprobs is not None and torch.isfinite(out.logprobs).all()
    assert out.nonfinite_rows == []


def test_a_model_with_nan_weights_fails_instead_of_answering(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "nan-model"
    shutil.copytree(tiny_llama_dir, broken)
    weights = broken / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"] *= float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    llm = LLM(broken, max_model_len=128, kv_cache_memory_bytes=4 * 2**20)
    [output] = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=4))
    assert output.outputs[0].finish_reason == "error"  # no token made up
    assert output.outputs[0].token_ids == []
    assert not llm.engine.has_unfinished()
