"""Sampler against plain-torch references; seeded sampling independent of the batch."""

from __future__ import annotations

import torch

from modelship.engine.sampler import SamplingMetadata, sample
from modelship.engine.sampling_params import SamplingParams

VOCAB = 50


def meta(params, prompts=None, outputs=None, generators=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)],
        generators or [None] * n,
        VOCAB,
        "cpu",
    )


def ref_top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    kth = torch.topk(logits, k).values[-1]
    return logits >= kth


def ref_top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    probs = logits.softmax(-1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    total = 0.0
    for index in probs.argsort(descending=True).tolist():
        keep[index] = True
        total += probs[index].item()
        if total >= p:
            break
    return keep


def support(logits: torch.Tensor, params: SamplingParams, draws: int = 300) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(draws):
        out = sample(logits.unsqueeze(0).clone(), meta([params], generators=[generator]))
        seen.add(int(out.token_ids[0]))
    return seen


def test_greedy_is_argmax_with_logprobs() -> None:
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(temperature=0, logprobs=3) for _ in range(3)]
    out = sample(logits.clone(), meta(params))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    reference = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, reference.max(-1).values)
    torch.testing.assert_close(out.top_logprobs, reference.topk(3).values)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())


def test_top_k_top_p_min_p_restrict_support() -> None:
    torch.manual_seed(1)
    logits = torch.randn(VOCAB) * 3
    allowed_k = set(ref_top_k_mask(logits, 5).nonzero().flatten().tolist())
    assert support(logits, SamplingParams(top_k=5)) <= allowed_k
    allowed_p = set(ref_top_p_mask(logits, 0.5).nonzero().flatten().tolist())
    assert support(logits, SamplingParams(top_p=0.5)) <= allowed_p
    probs = logits.softmax(-1)
    allowed_min = set((probs >= probs.max() * 0.2).nonzero().flatten().tolist())
    assert support(logits, SamplingParams(min_p=0.2)) <= allowed_min
    assert len(support(logits, SamplingParams())) > len(allowed_k)


def test_penalties_match_reference() -> None:
    logits = torch.randn(1, VOCAB)
    prompt, output = [1, 2, 3], [3, 4, 4]
    params = SamplingParams(
        temperature=0,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logprobs=0,
    )
    expected = logits[0].clone()
    for token in {1, 2, 3, 4}:
        value = expected[token]
        expected[token] = value / 1.3 if value > 0 else value * 1.3
    for token in set(output):
        expected[token] -= 0.5 * output.count(token) + 0.25
    out = sample(logits.clone(), meta([params], [prompt], [output]))
    assert int(out.token_ids[0]) == int(expected.argmax())
    torch.testing.assert_close(out.logprobs[0], expected.log_softmax(-1).max())


def test_seeded_sampling_is_independent_of_the_batch() -> None:
    torch.manual_seed(2)
    steps = [torch.randn(5, VOCAB) for _ in range(6)]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(position: int, batch: int) -> list[int]:
        generator = torch.Generator().manual_seed(1234)
        others = [torch.Generator().manual_seed(99) for _ in range(batch)]
        params = [SamplingParams(temperature=1.3, top_k=7) for _ in range(batch)]
        params[position] = seeded
        generators = list(others)
        generators[position] = generator
        tokens = []
        for logits in steps:
            rows = logits[:batch].clone()
            rows[position] = logits[0]
            out = sample(rows, meta(params, generators=generators))
            tokens.append(int(out.token_ids[position]))
        return tokens

    alone = run(0, 1)
    assert run(0, 4) == alone
    assert run(3, 5) == alone


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1] + [1e-9] * (VOCAB - 3)))
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(VOCAB)
    params = SamplingParams(temperature=1.0)
    for _ in range(2000):
        out = sample(logits.unsqueeze(0).clone(), meta([params], generators=[generator]))
        counts[int(out.token_ids[0])] += 1
    shares = counts[:3] / 2000
    assert abs(shares[0] - 0.7) < 0.05 and abs(shares[1] - 0.2) < 0.04
    assert counts[3:].sum() == 0


def test_mixed_greedy_and_random_rows() -> None:
    logits = torch.randn(2, VOCAB)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    out = sample(logits.clone(), meta(params, generators=[None, torch.Generator().manual_seed(0)]))
    assert int(out.token_ids[0]) == int(logits[0].argmax())
    assert out.logprobs is None


def test_top_k_and_logprobs_beyond_the_vocab_are_clamped_not_overflowed() -> None:
    params = SamplingParams(temperature=1.0, logprobs=5)
    params.top_k = 2**63  # past validation: the sampler must still not overflow int64
    params.logprobs = VOCAB + 10
    out = sample(torch.randn(1, VOCAB), meta([params], generators=[torch.Generator()]))
    assert 0 <= out.token_ids[0] < VOCAB
    assert out.top_logprob_ids.shape == (1, VOCAB)
