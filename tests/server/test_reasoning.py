"""`<think>` split from the answer (`server/reasoning.py`): whole texts, and the same texts
fed in every possible cut (a stream's pieces add up to the whole response's fields)."""

from __future__ import annotations

import pytest

from modelship.server.reasoning import ReasoningParser, ReasoningSplitter, Split

QWEN, R1 = ReasoningParser.qwen3, ReasoningParser.deepseek_r1


def split_in_pieces(parser, prompt_tail: str, pieces: list[str]) -> Split:
    splitter = ReasoningSplitter(parser, prompt_tail)
    total = Split()
    for piece in [*pieces, None]:
        part = splitter.feed(piece) if piece is not None else splitter.finish()
        total.reasoning += part.reasoning
        total.content += part.content
    return total


CASES = [
    # parser, prompt tail, output, reasoning, content
    (QWEN, "assistant\n", "<think>\nlet me see</think>\n\nYes", "\nlet me see", "Yes"),
    (QWEN, "assistant\n", "  <think>x</think>y", "x", "y"),
    (QWEN, "assistant\n", "no thinking here", "", "no thinking here"),
    (QWEN, "assistant\n", "a <think>b</think>", "", "a <think>b</think>"),  # not at the start
    (QWEN, "assistant\n", "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    (QWEN, "assistant\n<think>\n", "thinking</think>answer", "thinking", "answer"),  # opened
    (QWEN, "<think>a</think>\nassistant\n", "plain", "", "plain"),  # closed in the prompt
    (QWEN, "assistant\n", "<thin", "", "<thin"),  # a partial tag that never completes
    (QWEN, "assistant\n", "\n\n", "", "\n\n"),
    (R1, "assistant\n", "thinking</think>answer", "thinking", "answer"),
    (R1, "assistant\n", "<think>thinking</think>answer", "thinking", "answer"),
    (R1, "assistant\n", "never closed", "never closed", ""),
    (R1, "assistant\n", "x</thin", "x</thin", ""),
]


@pytest.mark.parametrize(("parser", "tail", "text", "reasoning", "content"), CASES)
def test_every_cut_of_the_stream_adds_up_to_the_whole(parser, tail, text, reasoning, content):
    assert split_in_pieces(parser, tail, [text]) == Split(reasoning, content)
    for cut in range(len(text) + 1):
        assert split_in_pieces(parser, tail, [text[:cut], text[cut:]]) == Split(reasoning, content)
    assert split_in_pieces(parser, tail, list(text)) == Split(reasoning, content)


def test_auto_follows_the_chat_template() -> None:
    auto = ReasoningParser.auto
    assert auto.resolve("{{ '<think>' }}") is QWEN
    assert auto.resolve("{{ messages }}") is ReasoningParser.none
    assert auto.resolve(None) is ReasoningParser.none
    assert R1.resolve("{{ messages }}") is R1
