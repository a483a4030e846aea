"""Golden answers: how a replica's answers are compared with the recorded reference."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from modelship.release import golden
from modelship.release.golden import (
    Agreement,
    GoldenAnswer,
    compare,
    read_reference,
    write_reference,
)

from server_process import ServerProcess


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


def test_other_tool_calls_on_the_same_tokens_do_not_agree() -> None:
    """A replica that reads the same tokens into other calls (another tool-call parser, a
    changed template) is drift on that prompt."""
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    reference = [GoldenAnswer("w", "", ["<", "call"], [-1.0, -1.0], [call])]
    same = [GoldenAnswer("w", "", ["<", "call"], [-1.0, -1.0], [call])]
    unparsed = [GoldenAnswer("w", "<call", ["<", "call"], [-1.0, -1.0], [])]
    assert compare(reference, same).tokens == 1.0
    assert compare(reference, unparsed).tokens == 0.0


def served_golden_answers(model_dir: Path, max_model_len: int) -> list[GoldenAnswer]:
    """`golden.ask_all` against a real replica of `model_dir`, started and stopped here."""
    server = ServerProcess(model_dir, "--served-model-name", "tiny", "--max-model-len",
                           str(max_model_len), "--kv-cache-memory-mb", "16")  # fmt: skip

    async def ask_all() -> list[GoldenAnswer]:
        async with httpx.AsyncClient() as client:
            return await golden.ask_all(client, server.url, "tiny")

    try:
        return asyncio.run(ask_all())
    finally:
        server.stop()


def test_the_golden_prompts_with_tools_are_served(tiny_llama_dir: Path) -> None:
    """Every golden prompt, the one that offers a tool included, is a request a replica
    accepts and answers with each token's logprob (what the drift probe compares)."""
    answers = served_golden_answers(tiny_llama_dir, 512)
    assert [a.prompt for a in answers] == list(golden.GOLDEN_PROMPTS)
    assert set(golden.GOLDEN_TOOLS) <= set(golden.GOLDEN_PROMPTS)
    assert all(a.tokens and len(a.tokens) == len(a.logprobs) for a in answers)
    assert compare(answers, answers).tokens == 1.0


def test_a_context_too_short_for_the_tool_prompt_leaves_it_out(tiny_llama_dir: Path) -> None:
    """A replica whose max_model_len cannot hold the tools' definitions refuses that prompt
    (400); the other answers are still the reference, without it."""
    answers = served_golden_answers(tiny_llama_dir, 128)
    assert [a.prompt for a in answers] == [
        p for p in golden.GOLDEN_PROMPTS if p not in golden.GOLDEN_TOOLS
    ]
