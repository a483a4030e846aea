"""Reasoning models' `<think>...</think>`, split from the answer: the message (and each
streamed delta) carries the thinking as `reasoning_content`, and as `reasoning` (the newer
name clients read), and only the answer as `content`.

Parsers (`serve --reasoning-parser`):
- `none`: all text is content.
- `qwen3`: reasoning is what a `<think>` at the start of the output opens, up to
  `</think>`; when the prompt itself ends inside an open `<think>` (a template that starts
  the thinking for the model), the output starts in reasoning.
- `deepseek_r1`: the output always starts in reasoning, up to `</think>` (R1 models often
  leave out the opening tag their template wrote); a leading `<think>` is dropped.
- `auto` (the default): `qwen3` when the chat template mentions `<think>`, else `none`.
The answer after `</think>` loses its leading whitespace; an unclosed block (the tokens ran
out) is all reasoning. Streaming and whole responses split with the same `ReasoningSplitter`,
so the pieces of a stream add up to the whole response's fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

START, END = "<think>", "</think>"


class ReasoningParser(StrEnum):
    auto = "auto"
    none = "none"
    qwen3 = "qwen3"
    deepseek_r1 = "deepseek_r1"

    def resolve(self, chat_template: Any) -> ReasoningParser:
        """The parser to run: `auto` decided from the chat template's text."""
        if self is not ReasoningParser.auto:
            return self
        return ReasoningParser.qwen3 if START in str(chat_template or "") else ReasoningParser.none


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Splits one choice's output, fed as it arrives, into reasoning and content. A tail
    that may be the start of a tag is held back until the next piece (or `finish`)."""

    def __init__(self, parser: ReasoningParser, prompt_tail: str) -> None:
        """`prompt_tail`: the end of the prompt's text (a `<think>` opened there and not
        closed puts the output in reasoning from its first token)."""
        opened = prompt_tail.rfind(START) > prompt_tail.rfind(END)
        # the output is reasoning even without an opening tag of its own
        self._implicit = parser is ReasoningParser.deepseek_r1 or opened
        self._may_open = True  # before any output: a `<think>` here opens the block
        self._in_reasoning = False
        self._strip = False  # just after `</think>`: the answer's leading whitespace goes
        self._pending = ""

    def feed(self, text: str) -> Split:
        split = Split()
        buf, self._pending = self._pending + text, ""
        while buf:
            if self._may_open:
                stripped = buf.lstrip()
                if stripped.startswith(START):
                    self._may_open, self._in_reasoning = False, True
                    buf = stripped[len(START) :]
                elif START.startswith(stripped):  # all whitespace or a partial tag
                    self._pending = buf
                    break
                else:
                    self._may_open, self._in_reasoning = False, self._implicit
            elif self._in_reasoning:
                end = buf.find(END)
                if end >= 0:
                    split.reasoning += buf[:end]
                    buf = buf[end + len(END) :]
                    self._in_reasoning, self._strip = False, True
                    continue
                keep = _partial_tag(buf, END)
                split.reasoning += buf[: len(buf) - keep]
                self._pending = buf[len(buf) - keep :]
                break
            else:
                if self._strip:
                    buf = buf.lstrip()
                    self._strip = not buf
                split.content += buf
                break
        return split

    def finish(self) -> Split:
        """What is held back, once the output has ended."""
        pending, self._pending = self._pending, ""
        if self._may_open:
            self._may_open, self._in_reasoning = False, self._implicit
        if self._in_reasoning:
            return Split(reasoning=pending)
        return Split(content=pending.lstrip() if self._strip else pending)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that starts `tag` (shorter than the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
