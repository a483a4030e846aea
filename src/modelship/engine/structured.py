"""Structured outputs: a request's grammar -> a compiled matcher per sequence -> token masks.

A `GrammarSpec` (`engine.grammar_spec`: JSON schema, any JSON object, regex, a list of
choices, or a Lark/GBNF grammar) rides on `EngineRequest.constraint` over the core pipe.
The engine's `GrammarCompiler` turns it into one llguidance `LLMatcher` per sequence
(`n > 1`: one each, all at the start state), compiling each distinct (kind, spec) once:
an LRU of start-state matchers, copied per sequence (a copy costs microseconds; the
compile with the tokenizer about a millisecond for a small schema).

The sequence owns its `GrammarMatcher` (`Sequence.grammar`): it advances on every token
the sequence accepts (`Sequence.append_token`), so preemption and recompute leave it in
the state of the tokens kept, a resumed request (gateway failover) advances it over the
resumed tokens at admission, and a stop string's dropped tokens roll it back. Each step,
the runner asks `fill_bitmask` for the rows of constrained sequences (one bit per token:
allowed or not), and the sampler masks the logits with it before anything else
(`sampler.apply_token_bitmask`). A sequence whose grammar is complete (nothing but EOS may
follow) finishes with "stop"; one that reaches `max_tokens` first ends with "length".

Why llguidance (over xgrammar): a prebuilt CPU wheel with no torch coupling (xgrammar
builds against torch and pulls its versions); an Earley parser over a lazily built lexer,
so masks take tens of microseconds on a 150k vocabulary and no grammar is precompiled per
token; JSON schema, regex and Lark grammars (GBNF converted) in one engine, with
unsupported JSON-schema keywords reported, not ignored.

Speculative decoding skips constrained sequences (no drafts for them): checking drafts
against the matcher and rolling it back is left for later.
"""

from __future__ import annotations

import copy
import json
import logging
from collections import OrderedDict
from typing import Any

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from modelship.engine.grammar_spec import GrammarSpec
from modelship.engine.sampling_params import InvalidParamsError

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


class GrammarMatcher:
    """One sequence's position in its grammar. `accept` advances it by a token."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance over `token_id`; False (and the matcher in its error state) if the
        grammar does not allow it, which the mask should have made impossible."""
        if self.matcher.consume_token(token_id):
            return True
        logger.error("grammar refused token %d: %s", token_id, self.matcher.get_error())
        return False

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and nothing but EOS may follow (output is valid)."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def is_error(self) -> bool:
        return self.matcher.is_error()


class GrammarCompiler:
    """Compiles `GrammarSpec`s against one model's tokenizer and hands out matchers.

    `eos_token_ids` are the tokens that end a sequence: a complete grammar allows them.
    The llguidance tokenizer (its own copy of the vocabulary: ~1.3 s to build for the demo
    model's 49k tokens, holding the GIL) is built on the first constrained request, so
    replicas that never see one do not pay it at start."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int] | set[int],
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_cached = max_cached
        self._lltokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def lltokenizer(self) -> LLTokenizer:
        if self._lltokenizer is None:
            backend = copy.copy(self.tokenizer.backend_tokenizer)
            backend.no_padding()
            backend.no_truncation()
            eos = self.eos_token_ids or [self.tokenizer.eos_token_id]
            self._lltokenizer = LLTokenizer(llguidance_tokenizer_json(backend.to_str()),
                                            n_vocab=self.vocab_size, eos_token=eos)  # fmt: skip
        return self._lltokenizer

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar; `InvalidParamsError` naming
        `spec.param` if it does not compile."""
        key = (spec.kind, spec.spec)
        start = self._cache.get(key)
        if start is None:
            start = LLMatcher(self.lltokenizer(), spec.grammar(), log_level=0)
            if start.is_error():
                raise InvalidParamsError(spec.param, f"{spec.param}: {start.get_error()}")
            self._cache[key] = start
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return GrammarMatcher(start.deep_copy())

    def attach(self, seqs: list, spec: GrammarSpec, resumed_token_ids: list[int]) -> None:
        """Give each sequence of one request its own matcher, advanced over the tokens an
        earlier replica already generated (`resumed_token_ids`, a failover resume)."""
        for seq in seqs:
            grammar = self.matcher(spec)
            for token_id in resumed_token_ids:
                if not grammar.matcher.consume_token(token_id):
                    raise InvalidParamsError(
                        "resume_token_ids", f"resume_token_ids do not match {spec.param}"
                    )
            seq.grammar = grammar


def llguidance_tokenizer_json(tokenizer_json: str) -> str:
    """The tokenizer as llguidance must read it. llguidance knows a byte-level vocabulary
    ("Ġ" for a space byte) only by a top-level ByteLevel decoder; a GGUF-converted
    tokenizer (the demo model's) wraps it in a Sequence with ByteFallback, Fuse and Replace
    steps, which then made every "Ġ" token the literal bytes of "Ġ" to the grammar (no
    JSON with a space could be sampled). The wrapped ByteLevel alone decodes the same."""
    data = json.loads(tokenizer_json)
    decoder = data.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        if byte_level:
            data["decoder"] = byte_level[0]
            return json.dumps(data)
    return tokenizer_json


class BitmaskFiller:
    """Fills the allowed-token bitmask of a batch's constrained rows, the matchers in
    parallel on llguidance's own threads (they run without the GIL)."""

    def __init__(self, num_threads: int | None = None) -> None:
        self._executor = LLExecutor(num_threads) if num_threads else LLExecutor()

    def fill(
        self, rows: list[tuple[GrammarMatcher, int]], num_rows: int, vocab_size: int
    ) -> torch.Tensor:
        """[num_rows, ceil(vocab / 32)] int32: bit t of row r set iff token t is allowed;
        rows not listed allow every token."""
        # Imported at the first constrained step, not with the engine: llguidance.torch
        # compiles a kernel with torch.compile at import, which loads torch._dynamo (sympy,
        # networkx, inductor), about half of a replica's import time, in every replica.
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

        bitmask = allocate_token_bitmask(num_rows, vocab_size)
        fill_next_token_bitmask_par(
            self._executor, [(grammar.matcher, row) for grammar, row in rows], bitmask
        )
        return bitmask


def grammar_rows(seqs: list, row_starts: list[int]) -> list[tuple[GrammarMatcher, int]]:
    """(matcher, sampler row) of each constrained sequence among `seqs` (a constrained
    sequence never drafts, so it has exactly the one row at its start)."""
    return [
        (seq.grammar, row_starts[index])
        for index, seq in enumerate(seqs)
        if seq.grammar is not None
    ]
