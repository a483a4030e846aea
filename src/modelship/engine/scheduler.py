"""Continuous batching: each step, a plan of how many tokens every sequence runs.

One accounting rule covers prefill, chunked prefill, decode and prefix hits: a scheduled
sequence runs `min(num_tokens - num_computed_tokens, remaining budget)` tokens, and its
computed tokens catch up with its tokens. Running sequences are served first, in `_order`
(higher priority, then lower completion index within its request, then earlier arrival:
a request's `n` completions take turns with later requests); when one cannot get a block,
the last running sequence in that order is preempted (blocks freed, recomputed later).
Waiting sequences are admitted in the same order, only in steps without such preemption,
so admission never evicts running work of the same priority; a higher-priority waiting
sequence does take the seat of a lower one when all `max_num_seqs` are taken. A step that
computes a prompt runs nothing of lower priority (no decode, no prompt chunk): its cost is
the high-priority request's time to first token, and on a CPU a step's cost grows with
every row in it.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from modelship.engine.block_manager import NO_HIT, BlockManager
from modelship.engine.errors import EngineOverloadedError, RequestTooLongError
from modelship.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # engine.config loads torch and the model's kernels; the policy reads fields
    from modelship.engine.config import EngineConfig


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    """The plan of one step, in batch order; `update_from_output` closes the loop."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


def _order(seq: Sequence) -> tuple[int, int, int]:
    """Both queues' order, first served first: priority, then completion index, then arrival.

    The index comes before arrival so that a request's `n` completions share the engine
    with later requests instead of queueing ahead of them all: every request's first
    completion precedes any request's second (round robin by index). Ordered by arrival
    alone, three silent `n=16` streams without `max_tokens` put 45 sequences of 250
    tokens, most of them preempted, ahead of a 2-token request on a 22-block KV cache,
    which then waited for all of them (minutes). Preemption takes the last in this order,
    so a request's extra completions give up their blocks before anyone's first does."""
    return (-seq.priority, seq.index, seq.arrival_seq)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []  # sorted by _order
        self.running: list[Sequence] = []  # sorted by _order
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._waiting_tokens = 0
        self._num_held_back = 0  # admitted siblings not queued yet (see add_request)
        self._held_back_tokens = 0

    # Admission -------------------------------------------------------------------------------
    def add_request(self, seq: Sequence, num_held_back: int = 0) -> None:
        """Queue `seq`. Raises `RequestTooLongError` if it can never run, and
        `EngineOverloadedError` if the queue is full. `num_held_back` more sequences of the
        same request (its `n > 1` siblings, same tokens) wait outside the queue until
        `release_held_back`; they count against the waiting limits from admission on, so a
        request cannot bring in more than the limits by asking for many completions."""
        max_tokens = seq.params.max_tokens or 0
        if seq.num_prompt_tokens + max(max_tokens, 1) > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                f"exceeds the maximum context length of {self.max_model_len} tokens"
            )
        total = seq.num_prompt_tokens + (max_tokens or self.max_model_len - seq.num_prompt_tokens)
        manager = self.block_manager
        # with a window (every layer's), the blocks before it go back as the sequence runs
        held = manager.max_blocks_held(total, self.config.max_num_batched_tokens)
        if held > manager.num_blocks:
            raise RequestTooLongError(
                f"request needs {min(total, held * manager.block_size)} tokens of KV cache "
                f"at once; the whole cache holds {manager.num_blocks * manager.block_size}"
            )
        num_seqs = 1 + num_held_back
        if self.num_waiting + num_seqs > self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"{self.num_waiting} requests waiting, {num_seqs} more asked for (limit "
                f"{self.config.max_waiting_requests})"
            )
        num_tokens = self._waiting_tokens + self._held_back_tokens
        if num_tokens + num_seqs * seq.num_tokens > self.config.max_waiting_tokens:
            raise EngineOverloadedError(
                f"{num_tokens} prompt tokens waiting (limit {self.config.max_waiting_tokens})"
            )
        self._enqueue(seq)
        self._num_held_back += num_held_back
        self._held_back_tokens += num_held_back * seq.num_tokens

    def release_held_back(self, seqs: list[Sequence]) -> None:
        """Queue siblings held back since their request was admitted (counted then)."""
        self.drop_held_back(seqs)
        for seq in seqs:
            self._enqueue(seq)

    def drop_held_back(self, seqs: list[Sequence]) -> None:
        """Forget siblings held back since admission that will never be queued (abort)."""
        self._num_held_back -= len(seqs)
        self._held_back_tokens -= sum(seq.num_tokens for seq in seqs)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_order)
        self._waiting_tokens += seq.num_tokens

    def _dequeue(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self._waiting_tokens -= seq.num_tokens

    # Planning --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput()
        # Prompt tokens this step may compute: one bounded chunk when streams decode in it
        # (their next token waits for the whole step), else the whole budget.
        num_decoding = sum(s.num_tokens - s.num_computed_tokens == 1 for s in self.running)
        budget = self.config.max_num_batched_tokens
        prefill_budget = budget
        if num_decoding:
            prefill_budget = max(0, min(self.config.max_prefill_chunk, budget - num_decoding))
        # Every seat taken and a higher priority waiting: the last running sequence in
        # `_order` (lowest priority) gives up its seat (recomputed later, its prompt blocks
        # likely still in the prefix cache), so a high-priority request waits for one step,
        # not for a low-priority one to finish its whole answer.
        while (
            self.waiting
            and len(self.running) >= self.config.max_num_seqs
            and self.waiting[0].priority > self.running[-1].priority
        ):
            self._preempt(self.running[-1])
        floor = self._prefill_priority()
        self._fill(plan, budget, prefill_budget, floor)
        if not plan.scheduled and not plan.preempted and floor is not None:
            # The prompt that set the floor could not get its blocks: run the rest.
            self._fill(plan, budget, prefill_budget, None)
        return plan

    def _fill(
        self, plan: SchedulerOutput, budget: int, prefill_budget: int, floor: int | None
    ) -> None:
        """Schedule running sequences, then admit waiting ones, none below `floor`."""
        manager = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if floor is not None and seq.priority < floor:
                break  # sorted: every later one is lower too
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 1 and seq.draft_token_ids:  # decode + drafts to verify
                del seq.draft_token_ids[budget - 1 :]
                if not manager.can_allocate(seq, 1 + len(seq.draft_token_ids)):
                    seq.draft_token_ids = []  # drafts never preempt anyone
                num_new += len(seq.draft_token_ids)
            elif num_new > 1:  # a prompt (or a recomputed prefix) still in prefill
                num_new = min(num_new, prefill_budget)
                if num_new == 0:
                    i += 1
                    continue
                prefill_budget -= num_new
            while not manager.can_allocate(seq, num_new):
                victim = self.running[-1]  # the last in `_order`
                self._preempt(victim)
                plan.preempted.append(victim.seq_id)
                if victim is seq:
                    break
            else:
                manager.allocate(seq, num_new)
                plan.scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break  # `seq` itself was preempted: everything after it was too
        if plan.preempted:
            return
        while (
            self.waiting
            and min(budget, prefill_budget) > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            if floor is not None and seq.priority < floor:
                break
            computed = manager.get_computed_blocks(seq) if not seq.block_table else NO_HIT
            num_computed = computed.num_tokens or seq.num_computed_tokens
            num_new = min(seq.num_tokens - num_computed, budget, prefill_budget)
            if not manager.can_allocate(seq, num_new, computed):
                break
            prefill_budget -= num_new
            self._dequeue(seq)
            manager.allocate(seq, num_new, computed)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, seq, key=_order)
            plan.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

    def _prefill_priority(self) -> int | None:
        """The highest priority with prompt tokens to compute this step (a running sequence
        in prefill, or the head of the queue when a seat is free), when something of lower
        priority would run beside it; None: no such step, everything may run."""
        # Both queues are sorted by priority, highest first.
        floor = next((seq.priority for seq in self.running
                      if seq.num_tokens - seq.num_computed_tokens > 1), None)  # fmt: skip
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            head = self.waiting[0].priority
            floor = head if floor is None else max(floor, head)
        if floor is None:
            return None
        lowest = min(queue[-1].priority for queue in (self.running, self.waiting) if queue)
        return floor if lowest < floor else None

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free the blocks, forget computed tokens, wait again."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.draft_token_ids = []
        seq.draft_probs = None
        seq.num_computed_tokens = 0
        seq.num_draft_computed_tokens = 0  # its blocks are gone: the draft's KV too
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)

    # Closing the loop -----------------------------------------------------------------------
    def update_from_output(
        self, plan: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[Sequence]:
        """Advance computed tokens, append sampled tokens, finish and free; returns finished.

        A sequence's sampled tokens are one, or with drafts (speculative decoding) the
        accepted drafts and the token after them: its computed tokens advance over the
        accepted ones only (the rejected drafts' KV slots are written again later), and
        its tokens stop at the first that finishes it. Blocks reserved for rejected drafts
        go back to the pool (`BlockManager.trim`)."""
        finished = []
        for scheduled in plan.scheduled:
            seq = scheduled.seq
            num_drafts = len(seq.draft_token_ids)
            seq.draft_token_ids = []
            seq.draft_probs = None
            if seq.is_finished:  # aborted while its step ran
                continue
            token_ids = sampled.get(seq.seq_id) or []
            num_rejected = num_drafts - (len(token_ids) - 1) if token_ids else num_drafts
            computed = seq.num_computed_tokens + scheduled.num_new_tokens - num_rejected
            if computed <= seq.num_prompt_tokens:
                self.num_prompt_tokens += scheduled.num_new_tokens
            reason = None
            for token_id in token_ids:
                seq.append_token(token_id)
                self.num_generation_tokens += 1
                reason = self._finish_reason(seq, token_id)
                if reason is not None:
                    break
            seq.num_computed_tokens = min(computed, seq.num_tokens)
            self.block_manager.cache_full_blocks(seq)
            self.block_manager.free_outside_window(seq)
            if num_rejected and reason is None:
                self.block_manager.trim(seq, seq.num_tokens)
            if reason is not None:
                self.finish(seq.seq_id, reason)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        num_output = seq.num_output_tokens
        if seq.grammar is not None and seq.grammar.is_finished:
            return "stop"  # its grammar is complete: ignore_eos and min_tokens cannot extend it
        if seq.grammar is not None and seq.grammar.is_error:
            return "abort"  # a token outside the grammar (the mask forbids it): never "stop"
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
            if token_id in params.stop_token_ids:
                return "stop"
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq_id: str, reason: str) -> Sequence | None:
        """End a sequence now (stop string, abort) and free its blocks at once."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.seq_id == seq_id:
                    if queue is self.waiting:
                        self._dequeue(seq)
                    else:
                        queue.remove(seq)
                    self.block_manager.free(seq)
                    seq.finish(reason)
                    return seq
        return None

    def abort(self, seq_id: str) -> Sequence | None:
        return self.finish(seq_id, "abort")

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Queued sequences plus the held-back siblings of admitted requests."""
        return len(self.waiting) + self._num_held_back

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)
