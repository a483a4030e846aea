"""A sequence: the engine's state for one completion. It owns its tokens and block table."""

from __future__ import annotations

import itertools
import time
from enum import Enum
from typing import TYPE_CHECKING, Any

from modelship.engine.sampling_params import SamplingParams

_arrivals = itertools.count()

if TYPE_CHECKING:
    from modelship.engine.structured import GrammarMatcher
    from modelship.model.lora import LoRAAdapter


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt then output), how many are computed, and where they live.

    The block manager changes `block_table` and `num_cached_tokens` (allocate/free); the
    scheduler changes `num_computed_tokens` and `status`; the runner only reads.
    Invariant: `num_computed_tokens <= num_tokens`, and the block table covers at least
    `num_computed_tokens` slots while running.
    """

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: LoRAAdapter | None = None,
        index: int = 0,
    ) -> None:
        self.seq_id = seq_id
        self.index = index  # which of its request's `n` completions (OpenAI's choice index)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt  # prefix-cache namespace: only equal salts share blocks
        self.lora = lora  # the adapter its tokens run with; also a prefix-cache namespace
        self.arrival_seq = next(_arrivals)  # FCFS order, also across preemptions
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of this sequence's full blocks, in order
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # speculative tokens proposed for the next step (verified, never part of token_ids
        # until accepted); the scheduler runs them after the last token
        self.draft_token_ids: list[int] = []
        # An embedding request (`params.pooling`): the pooled hidden states so far (a
        # tensor), how many prompt positions they hold, and the embedding once complete
        self.pooled: Any = None
        self.pooled_upto = 0
        self.embedding: list[float] | None = None
        # draft-model speculation (`engine.draft`): the draft's probabilities of those
        # drafts ([len(drafts), vocab] tensor; None for prompt lookup and greedy requests),
        # and how many leading tokens have their KV in the draft's cache (0 after preemption)
        self.draft_probs = None
        self.num_draft_computed_tokens = 0
        # structured outputs: where its output stands in the request's grammar (advanced by
        # `append_token`, so a preempted and recomputed sequence keeps it); None: free text
        self.grammar: GrammarMatcher | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def queue_time_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def drop_last_tokens(self, count: int) -> None:
        """Forget the last `count` generated tokens (sampled past a stop string)."""
        if count:
            del self.token_ids[-count:]
            if self.grammar is not None:
                self.grammar.rollback(count)
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
