"""Prompt-lookup speculative decoding: drafting, verification, and the engine's output with
it on equal to the output with it off (greedy: the same tokens; sampled: the same
distribution), through stop strings, max_tokens, logprobs, preemption and batching."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from modelship.engine import LLM, SamplingParams
from modelship.engine.sequence import Sequence
from modelship.engine.speculative import (
    MIN_GAIN,
    SpeculationTracker,
    SpeculativeConfig,
    accepted_prefix,
    expected_gain,
    propose_ngram,
)

# A prompt that repeats itself: the continuation a model gives is full of n-grams it saw.
PROMPT = "one two three four five six seven. one two three four five six seven. one two"


def test_prompt_lookup_takes_the_latest_occurrence_of_the_longest_suffix() -> None:
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    assert propose_ngram(tokens, 3, 1, 3) == [8, 2, 5]  # "5 6" last seen at 4 -> 8 2 5
    assert propose_ngram(tokens, 3, 3, 3) == []  # "6 5 6"... "x 5 6": 8 2? no: 2 5 6 unseen
    assert propose_ngram([1, 2, 3, 4], 2, 1, 3) == []  # nothing repeats
    assert propose_ngram([4, 9, 4], 5, 1, 2) == [9, 4]  # runs to the end of the sequence
    assert propose_ngram([7], 3, 1, 3) == []


def test_verification_keeps_matching_drafts_and_the_sample_after_them() -> None:
    assert accepted_prefix([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]  # all, plus a bonus
    assert accepted_prefix([1, 2, 3], [1, 9, 3, 4]) == [1, 9]  # the correction ends it
    assert accepted_prefix([1, 2, 3], [8, 2, 3, 4]) == [8]
    assert accepted_prefix([], [5]) == [5]


def test_the_expected_gain_weighs_accepted_runs_against_the_rows_they_cost() -> None:
    assert expected_gain(0.0, 4, 0.3) == pytest.approx(1 / 2.2)  # only the correction
    assert expected_gain(1.0, 4, 0.0) == 5  # every draft and the bonus, rows free
    assert expected_gain(0.5, 2, 0.0) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_gain(0.7, 1, 0.3) == pytest.approx(1.7 / 1.3)


def test_each_sequence_drafts_what_pays_and_stops_when_nothing_does() -> None:
    tracker = SpeculationTracker(SpeculativeConfig(num_tokens=8, draft_token_cost=0.3))
    seq = Sequence("s", [1, 2, 3], SamplingParams())
    fresh = tracker.num_to_draft(seq, True, room=100)
    assert fresh >= 1 and tracker.num_to_draft(seq, False, room=100) == 0
    assert tracker.num_to_draft(seq, True, room=1) == 1  # never past max_tokens
    # Quoting text: long accepted runs -> the most drafts.
    good = Sequence("g", [1, 2, 3], SamplingParams())
    for _ in range(10):
        tracker.record("g", 8, 8)
    assert tracker.num_to_draft(good, True, room=100) == 8
    # In a batch the other sequences wait for the drafted rows: fewer pay, none at 0.8.
    assert 0 < tracker.num_to_draft(good, True, room=100, batch_size=8) < 8
    tracker.record("m", 10, 8)  # acceptance (8 + 3) / (8 + 2 + 4) ~ 0.79
    middling = Sequence("m", [1], SamplingParams())
    assert tracker.num_to_draft(middling, True, room=100, batch_size=8) == 0
    assert tracker.num_to_draft(middling, True, room=100) > 0  # not stopped: alone it pays
    # Open text: every draft rejected -> fewer drafts, then none, for good.
    counts = []
    for _ in range(6):
        counts.append(tracker.num_to_draft(seq, True, room=100))
        if counts[-1]:
            tracker.record("s", counts[-1], 0)
    assert counts[0] == fresh and counts[-1] == 0 and counts == sorted(counts, reverse=True)
    assert max(expected_gain(tracker.acceptance("s"), k, 0.3) for k in range(1, 9)) < MIN_GAIN
    tracker.record("s", 4, 4)  # a stopped sequence does not come back on its own
    assert tracker.num_to_draft(seq, True, room=100) == 0
    tracker.forget("s")
    assert tracker.num_to_draft(seq, True, room=100) == fresh
    # Free rows (a GPU): even a poor acceptance drafts every token it may.
    free = SpeculationTracker(SpeculativeConfig(num_tokens=4, draft_token_cost=0.0))
    free.record("f", 4, 1)
    assert free.num_to_draft(Sequence("f", [1], SamplingParams()), True, room=100) == 4


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path):
    plain = LLM(tiny_llama_dir, num_kv_blocks=256)
    spec = LLM(
        tiny_llama_dir,
        num_kv_blocks=256,
        # rows free: every sequence drafts whatever the batch, so drafts are always at stake
        speculative=SpeculativeConfig(
            num_tokens=4, by_default=True, max_batch_size=512, draft_token_cost=0.0
        ),
    )
    return plain, spec


def _accepted(llm: LLM) -> int:
    return llm.engine.stats().spec_num_accepted_tokens


def test_greedy_output_and_logprobs_are_those_of_plain_decoding(engines) -> None:
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    accepted = _accepted(spec)
    expected = plain.generate([PROMPT, "seven six five"], params)
    got = spec.generate([PROMPT, "seven six five"], params)
    assert _accepted(spec) > accepted  # drafts were verified and kept
    for want, have in zip(expected, got, strict=True):
        want, have = want.outputs[0], have.outputs[0]
        assert have.token_ids == want.token_ids
        assert have.text == want.text
        assert len(have.token_ids) == 40 and have.finish_reason == "length"
        assert [lp.token_id for lp in have.logprobs] == have.token_ids
        for a, b in zip(have.logprobs, want.logprobs, strict=True):
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-3)
            assert set(a.top) == set(b.top)


def test_a_stop_string_inside_accepted_drafts_ends_the_text_there(engines) -> None:
    plain, spec = engines
    reference = plain.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30))[0]
    text = reference.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # some text from the middle
    assert stop.strip()
    params = SamplingParams(temperature=0, max_tokens=30, stop=[stop])
    want = plain.generate([PROMPT], params)[0].outputs[0]
    have = spec.generate([PROMPT], params)[0].outputs[0]
    assert have.finish_reason == want.finish_reason == "stop"
    assert (have.text, have.token_ids) == (want.text, want.token_ids)


def test_preemption_with_drafts_in_flight_changes_no_output(tiny_llama_dir: Path) -> None:
    """A KV cache too small for every sequence at once: sequences are preempted and
    recomputed while others verify drafts; every output equals plain decoding's."""
    prompts = [f"{PROMPT} {i}" for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    small = {"num_kv_blocks": 14, "block_size": 8, "max_model_len": 128}
    plain = LLM(tiny_llama_dir, **small).generate(prompts, params)
    llm = LLM(
        tiny_llama_dir,
        **small,
        speculative=SpeculativeConfig(num_tokens=4, by_default=True, max_batch_size=64),
    )
    got = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    assert _accepted(llm) > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.block_manager.num_free_blocks == 14  # every slot given back


def test_requests_opt_in_and_out(tiny_llama_dir: Path) -> None:
    llm = LLM(tiny_llama_dir, speculative=SpeculativeConfig(num_tokens=4))  # not by default
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate([PROMPT], params)
    assert llm.engine.stats().spec_num_drafts == 0
    params.speculative = True
    llm.generate([PROMPT], params)
    assert llm.engine.stats().spec_num_drafts > 0


def test_sampled_output_has_the_distribution_of_plain_sampling(engines) -> None:
    """Seeded draws, many of them, at a temperature that makes the random model's near-flat
    logits a mix of a few likely tokens (about 3 drafts in 4 accepted): the tokens at
    positions where drafts were accepted follow the same distribution with and without
    speculation (a chi-square two-sample test per position; a biased verifier, e.g. one
    that keeps every proposed draft, fails it by a wide margin)."""
    plain, spec = engines
    num_draws, length = 400, 8
    prompts = [PROMPT] * num_draws

    def draws(llm: LLM) -> list[list[int]]:
        params = [
            SamplingParams(temperature=0.04, top_k=3, max_tokens=length, ignore_eos=True, seed=seed)
            for seed in range(num_draws)
        ]
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    accepted = _accepted(spec)
    expected, got = draws(plain), draws(spec)
    assert _accepted(spec) - accepted > num_draws  # drafts were at stake
    for position in range(1, length):
        a = Counter(tokens[position] for tokens in expected)
        b = Counter(tokens[position] for tokens in got)
        statistic, dof = _chi_square(a, b)
        # p < 1e-4 at these degrees of freedom: a fair verifier fails once in 10,000 runs
        assert statistic < _critical(dof), (position, a.most_common(5), b.most_common(5))


def _chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square over the tokens seen (rare ones pooled into one bin)."""
    total_a, total_b = sum(a.values()), sum(b.values())
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    bins = [(a[t], b[t]) for t in common]
    rest = (total_a - sum(x for x, _ in bins), total_b - sum(y for _, y in bins))
    if sum(rest):
        bins.append(rest)
    statistic = 0.0
    for x, y in bins:
        n = x + y
        for observed, total in ((x, total_a), (y, total_b)):
            expected = n * total / (total_a + total_b)
            statistic += (observed - expected) ** 2 / expected
    return statistic, max(1, len(bins) - 1)


def _critical(dof: int) -> float:
    """The chi-square quantile at 1 - 1e-4 (Wilson-Hilferty approximation)."""
    z = 3.719  # standard normal quantile at 1 - 1e-4
    h = 2 / (9 * dof)
    return dof * (1 - h + z * math.sqrt(h)) ** 3
