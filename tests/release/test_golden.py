"""Golden answers: how a replica's answers are compared with the recorded reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelship.release.golden import (
    Agreement,
    GoldenAnswer,
    compare,
    read_reference,
    write_reference,
)


def answer(prompt: str, tokens: str, logprobs: list[float] | None = None) -> GoldenAnswer:
    return GoldenAnswer(prompt, tokens, list(tokens), logprobs or [-1.0] * len(tokens))


def test_identical_answers_agree_fully() -> None:
    reference = [answer("a", "hello"), answer("b", "world")]
    assert compare(reference, list(reversed(reference))) == Agreement(1.0, 0.0)


def test_agreement_is_the_share_before_the_first_different_token() -> None:
    reference = [answer("a", "abcd"), answer("b", "wxyz")]
    observed = [answer("a", "abXd"), answer("b", "wxyz", [-1.0, -1.25, -1.0, -1.0])]
    result = compare(reference, observed)
    assert result.tokens == pytest.approx((2 / 4 + 1.0) / 2)
    assert result.max_logprob_delta == pytest.approx(0.25)
    # a longer or shorter answer is a difference too; a prompt not answered counts 0
    assert compare([answer("a", "abcd")], [answer("a", "abcdef")]).tokens == pytest.approx(4 / 6)
    assert compare(reference, [answer("a", "abcd")]).tokens == pytest.approx(0.5)


def test_references_round_trip_and_a_missing_file_is_none(tmp_path: Path) -> None:
    reference = [answer("a", "hi", [-0.5, -0.25])]
    write_reference(tmp_path / "golden.json", reference)
    assert read_reference(tmp_path / "golden.json") == reference
    assert read_reference(tmp_path / "missing.json") is None
