"""Fill-in-the-middle prompts for `suffix`, on models whose vocabulary has FIM tokens.

A code model trained for infilling reads `<prefix token>PREFIX<suffix token>SUFFIX<middle
token>` and generates the middle (the "PSM" order). The three tokens are found by name in
the tokenizer's vocabulary; a model without a full set cannot infill, so its `suffix` is a
400 naming it, never dropped (it would generate a plain continuation that ignores the
text after it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# (prefix, suffix, middle), in the spellings of the model families that use PSM order.
_FIM_TOKEN_SETS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)  # fmt: skip


@dataclass(frozen=True)
class FimTokens:
    prefix: str
    suffix: str
    middle: str

    @classmethod
    def find(cls, tokenizer: Any) -> FimTokens | None:
        """The tokenizer's FIM tokens, or None when it has no full set."""
        vocab = tokenizer.get_vocab()
        for names in _FIM_TOKEN_SETS:
            if all(name in vocab for name in names):
                return cls(*names)
        return None

    def prompt(self, prefix: str, suffix: str) -> str:
        """The infilling prompt; the tokenizer reads the three names as their tokens."""
        return f"{self.prefix}{prefix}{self.suffix}{suffix}{self.middle}"
