"""Incremental detokenization with stop strings.

Text is decoded over a small window of recent tokens (prefix/read offsets), so each new
token costs O(1) however long the output is. Two things are held back until they resolve:
a trailing U+FFFD (a multi-byte character split across tokens), and a suffix that could be
the start of a stop string. Nothing past a stop string is ever emitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelship.engine.sampling_params import SamplingParams

# How many tokens before the new ones are re-decoded, so merges and spaces come out right.
_WINDOW = 6


@dataclass(frozen=True)
class DetokenizerOutput:
    delta_text: str
    stop_reason: str | None  # the stop string that ended the text, if one did


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = [s for s in params.stop if s]
        self.include_stop = params.include_stop_str_in_output
        self.token_ids = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""  # all decoded output text, including what is held back
        self.num_emitted = 0  # characters of `text` already returned
        self.stopped = False

    @property
    def output_text(self) -> str:
        return self.text[: self.num_emitted]

    def update(self, new_token_ids: list[int]) -> DetokenizerOutput:
        if self.stopped:
            return DetokenizerOutput("", None)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.text += self._decode_next()
        return self._emit()

    def flush(self) -> str:
        """At the end of a sequence: release whatever was held back (it never completed)."""
        if self.stopped:
            return ""
        rest = self._decode(self.token_ids[self.prefix_offset :])
        done = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        self.text += rest[len(done) :]
        self.read_offset = len(self.token_ids)
        delta = self.text[self.num_emitted :]
        self.num_emitted = len(self.text)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self) -> str:
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete character (or nothing visible yet): wait for more
        new_text = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        # Keep the window small: drop tokens that can no longer affect decoding.
        if self.prefix_offset > _WINDOW:
            drop = self.prefix_offset - _WINDOW
            del self.token_ids[:drop]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return new_text

    def _emit(self) -> DetokenizerOutput:
        pending = self.text[self.num_emitted :]
        if not self.stop:
            self.num_emitted = len(self.text)
            return DetokenizerOutput(pending, None)
        match_at, matched = -1, None
        for stop in self.stop:
            at = pending.find(stop)
            if at != -1 and (match_at == -1 or at < match_at):
                match_at, matched = at, stop
        if matched is not None:
            end = match_at + (len(matched) if self.include_stop else 0)
            delta = pending[:end]
            self.text = self.text[: self.num_emitted] + delta
            self.num_emitted = len(self.text)
            self.stopped = True
            return DetokenizerOutput(delta, matched)
        hold = _longest_stop_prefix_suffix(pending, self.stop)
        delta = pending[: len(pending) - hold]
        self.num_emitted += len(delta)
        return DetokenizerOutput(delta, None)


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:length]):
                best = length
                break
    return best
