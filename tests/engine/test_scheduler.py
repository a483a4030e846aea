"""Scheduler: chunked prefill, budget, priorities, admission, preemption, abort."""

from __future__ import annotations

import pytest

from modelship.engine.block_manager import BlockManager
from modelship.engine.config import EngineConfig
from modelship.engine.errors import EngineOverloadedError, RequestTooLongError
from modelship.engine.sampling_params import SamplingParams
from modelship.engine.scheduler import Scheduler
from modelship.engine.sequence import Sequence

EOS = 0


def make(num_blocks=64, block_size=4, max_model_len=256, **config) -> Scheduler:
    settings = {"max_num_batched_tokens": 16, "max_num_seqs": 8, **config}
    return Scheduler(
        EngineConfig(block_size=block_size, **settings),
        BlockManager(num_blocks, block_size),
        max_model_len=max_model_len,
        eos_token_ids={EOS},
    )


def request(
    name: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, base=1, index: int = 0
):
    tokens = [base + i for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=False)
    return Sequence(name, tokens, params, priority=priority, index=index)


def step(scheduler: Scheduler, token: int = 7):
    """One fake model step: every sequence that completed its tokens samples `token`."""
    plan = scheduler.schedule()
    sampled = {
        s.seq.seq_id: [token]
        for s in plan.scheduled
        if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens
    }
    finished = scheduler.update_from_output(plan, sampled)
    scheduler.block_manager.check_integrity()
    scheduler.block_manager.check_tables(scheduler.running)
    return plan, finished


def test_chunked_prefill_within_budget() -> None:
    scheduler = make(max_num_batched_tokens=16)
    scheduler.add_request(request("long", 40))
    plan, _ = step(scheduler)
    assert [(s.seq.seq_id, s.num_new_tokens) for s in plan.scheduled] == [("long", 16)]
    plan, _ = step(scheduler)
    assert plan.scheduled[0].num_new_tokens == 16
    seq = plan.scheduled[0].seq
    assert seq.num_output_tokens == 0  # partial prefill samples nothing
    plan, _ = step(scheduler)
    assert plan.scheduled[0].num_new_tokens == 8
    assert seq.num_output_tokens == 1
    plan, _ = step(scheduler)
    assert plan.scheduled[0].num_new_tokens == 1  # decode: one token, same accounting rule


def test_while_streams_decode_new_prompts_run_in_bounded_chunks() -> None:
    scheduler = make(max_num_batched_tokens=64, max_prefill_chunk=8, max_model_len=512)
    scheduler.add_request(request("a", 4, max_tokens=50))
    scheduler.add_request(request("b", 4, max_tokens=50, base=100))
    plan, _ = step(scheduler)  # nothing decodes yet: both prompts in one step
    assert sorted(s.num_new_tokens for s in plan.scheduled) == [4, 4]
    scheduler.add_request(request("late", 30, max_tokens=4, base=200))
    chunks = []
    while True:
        plan, _ = step(scheduler)
        sizes = {s.seq.seq_id: s.num_new_tokens for s in plan.scheduled}
        assert sizes["a"] == sizes["b"] == 1  # the streams advance every step
        chunks.append(sizes["late"])
        if sizes["late"] == 1:
            break
    assert chunks == [8, 8, 8, 6, 1]  # 30 prompt tokens, at most 8 a step, then decode


def test_a_step_that_decodes_nothing_takes_the_whole_budget_of_prompt() -> None:
    scheduler = make(max_num_batched_tokens=64, max_prefill_chunk=8, max_model_len=512)
    scheduler.add_request(request("one", 40))
    scheduler.add_request(request("two", 40, base=100))
    plan, _ = step(scheduler)
    assert [s.num_new_tokens for s in plan.scheduled] == [40, 24]


def test_budget_and_max_num_seqs_every_step() -> None:
    scheduler = make(max_num_batched_tokens=12, max_num_seqs=3)
    for i in range(6):
        scheduler.add_request(request(f"r{i}", 5 + i, max_tokens=3, base=100 * i))
    for _ in range(40):
        if not scheduler.has_unfinished():
            break
        plan, _ = step(scheduler)
        assert plan.num_batched_tokens <= 12
        assert scheduler.num_running <= 3
    assert not scheduler.has_unfinished()


def test_priorities_then_fcfs() -> None:
    scheduler = make(max_num_batched_tokens=8, max_num_seqs=1)
    scheduler.add_request(request("low-1", 4, priority=0, base=10))
    scheduler.add_request(request("high", 4, priority=5, base=20))
    scheduler.add_request(request("low-2", 4, priority=0, base=30))
    order = []
    for _ in range(30):
        _plan, finished = step(scheduler)
        order += [s.seq_id for s in finished]
    assert order == ["high", "low-1", "low-2"]


def test_a_requests_completions_take_turns_with_later_requests() -> None:
    """Seats go to every request's first completion before any request's second: a later
    single request is admitted ahead of an earlier request's extra completions."""
    scheduler = make(max_num_seqs=2)
    for index in range(3):  # one request, n=3 (siblings share the prompt)
        scheduler.add_request(request(f"a:{index}", 4, base=10, index=index))
    scheduler.add_request(request("b:0", 4, base=20))
    plan, _ = step(scheduler)
    assert [s.seq.seq_id for s in plan.scheduled] == ["a:0", "b:0"]
    assert [seq.seq_id for seq in scheduler.waiting] == ["a:1", "a:2"]


def test_a_requests_extra_completions_are_preempted_before_a_later_first() -> None:
    """Out of blocks, the victim is the last in order: the earlier request's second
    completion, not the later request's first (ordered by arrival alone, that one went)."""
    scheduler = make(num_blocks=5, block_size=4, max_num_batched_tokens=16)
    scheduler.add_request(request("a:0", 4, max_tokens=8, base=10))
    scheduler.add_request(request("a:1", 4, max_tokens=8, base=10, index=1))
    scheduler.add_request(request("b:0", 4, max_tokens=8, base=20))
    plan, _ = step(scheduler)  # three prompts of one block each
    assert [s.seq.seq_id for s in plan.scheduled] == ["a:0", "b:0", "a:1"]
    plan, _ = step(scheduler)  # each decode needs a second block; two are left
    assert [s.seq.seq_id for s in plan.scheduled] == ["a:0", "b:0"]
    assert plan.preempted == ["a:1"]
    assert [seq.seq_id for seq in scheduler.waiting] == ["a:1"]


def test_admission_overload_is_typed() -> None:
    scheduler = make(max_waiting_requests=2)
    scheduler.add_request(request("a", 4))
    scheduler.add_request(request("b", 4))
    with pytest.raises(EngineOverloadedError) as info:
        scheduler.add_request(request("c", 4))
    assert "2 requests waiting" in info.value.reason
    by_tokens = make(max_waiting_tokens=10)
    by_tokens.add_request(request("a", 8))
    with pytest.raises(EngineOverloadedError):
        by_tokens.add_request(request("b", 8))


def test_held_back_siblings_count_against_the_waiting_limits() -> None:
    """A request with n completions brings n sequences: admission counts them all, from
    admission until the siblings are queued (or dropped by an abort)."""
    scheduler = make(max_waiting_requests=4)
    first = request("a:0", 4)
    siblings = [request(f"a:{i}", 4) for i in (1, 2)]
    with pytest.raises(EngineOverloadedError):
        scheduler.add_request(request("big:0", 4), num_held_back=4)  # 5 sequences > 4
    scheduler.add_request(first, num_held_back=len(siblings))
    assert scheduler.num_waiting == 3
    scheduler.add_request(request("b", 4))
    with pytest.raises(EngineOverloadedError):
        scheduler.add_request(request("c", 4))  # 4 waiting, two of them held back
    scheduler.release_held_back(siblings)
    assert scheduler.num_waiting == 4 and len(scheduler.waiting) == 4
    with pytest.raises(EngineOverloadedError):
        scheduler.add_request(request("c", 4))

    by_tokens = make(max_waiting_tokens=20)
    by_tokens.add_request(request("x:0", 8), num_held_back=1)  # 16 tokens
    with pytest.raises(EngineOverloadedError):
        by_tokens.add_request(request("y", 8))
    by_tokens.drop_held_back([request("x:1", 8)])  # the sibling was aborted
    by_tokens.add_request(request("y", 8))


def test_requests_that_can_never_fit_are_rejected() -> None:
    scheduler = make(max_model_len=32, num_blocks=4, block_size=4)
    with pytest.raises(RequestTooLongError, match="maximum context length of 32"):
        scheduler.add_request(request("a", 30, max_tokens=8))
    with pytest.raises(RequestTooLongError, match="whole cache holds 16"):
        scheduler.add_request(request("b", 10, max_tokens=10))


def test_preemption_under_a_tiny_pool_finishes_everyone() -> None:
    # 6 blocks of 2 tokens; three requests of 3 prompt + 6 output tokens cannot all fit.
    scheduler = make(num_blocks=6, block_size=2, max_num_batched_tokens=16)
    scheduler.add_request(request("old", 3, max_tokens=6, priority=1, base=10))
    scheduler.add_request(request("mid", 3, max_tokens=6, priority=1, base=20))
    scheduler.add_request(request("new", 3, max_tokens=6, priority=0, base=30))
    preempted, finished = [], []
    for _ in range(100):
        if not scheduler.has_unfinished():
            break
        plan, done = step(scheduler)
        preempted += plan.preempted
        finished += [s.seq_id for s in done]
    assert sorted(finished) == ["mid", "new", "old"]
    assert preempted and preempted[0] == "new"  # lowest priority goes first
    assert scheduler.num_preemptions == len(preempted)
    assert scheduler.block_manager.num_free_blocks == 6


def test_abort_frees_blocks_at_once() -> None:
    scheduler = make()
    scheduler.add_request(request("a", 10, max_tokens=50))
    scheduler.add_request(request("w", 10, max_tokens=50, base=100))
    step(scheduler)
    used = scheduler.block_manager.num_blocks - scheduler.block_manager.num_free_blocks
    assert used > 0
    aborted = scheduler.abort("a")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert aborted.block_table == []
    assert scheduler.abort("missing") is None
    scheduler.abort("w")
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert not scheduler.has_unfinished()


def test_prefix_hit_skips_computed_tokens() -> None:
    scheduler = make(max_num_batched_tokens=64)
    scheduler.add_request(request("first", 13, max_tokens=1))
    while scheduler.has_unfinished():
        step(scheduler)
    scheduler.add_request(request("second", 13, max_tokens=1))
    plan, _ = step(scheduler)
    assert plan.scheduled[0].num_new_tokens == 1  # 12 tokens (3 blocks) came from the cache
    assert plan.scheduled[0].seq.num_cached_tokens == 12


def test_eos_and_stop_token_ids_finish_with_stop() -> None:
    scheduler = make()
    scheduler.add_request(request("eos", 4, max_tokens=10))
    _, finished = step(scheduler, token=EOS)
    assert [s.finish_reason for s in finished] == ["stop"]
    seq = Sequence("stop-id", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[9]))
    scheduler.add_request(seq)
    _, finished = step(scheduler, token=9)
    assert finished == [seq] and seq.finish_reason == "stop"
    ignore = Sequence("ignore", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add_request(ignore)
    step(scheduler, token=EOS)
    _, finished = step(scheduler, token=EOS)
    assert finished == [ignore] and ignore.finish_reason == "length"


def test_a_higher_priority_takes_the_seat_of_a_lower_one() -> None:
    """All seats taken by low priority: a high-priority arrival runs in the next step (the
    newest low one is preempted and finishes later), instead of waiting for a low one to
    finish its answer; equal priorities never preempt each other for a seat."""
    scheduler = make(max_num_batched_tokens=32, max_num_seqs=2)
    scheduler.add_request(request("low-1", 4, max_tokens=20, base=10))
    scheduler.add_request(request("low-2", 4, max_tokens=20, base=20))
    step(scheduler)
    scheduler.add_request(request("low-3", 4, max_tokens=2, base=30))
    step(scheduler)
    assert {s.seq_id for s in scheduler.running} == {"low-1", "low-2"}  # no seat taken
    scheduler.add_request(request("high", 4, max_tokens=2, priority=5, base=40))
    plan, _ = step(scheduler)
    assert "high" in {s.seq.seq_id for s in plan.scheduled}
    assert {s.seq_id for s in scheduler.running} == {"high", "low-1"}
    finished = []
    for _ in range(80):
        if not scheduler.has_unfinished():
            break
        finished += [s.seq_id for s in step(scheduler)[1]]
    assert finished[0] == "high"
    assert sorted(finished) == ["high", "low-1", "low-2", "low-3"]
    assert scheduler.num_preemptions == 1


def test_a_step_that_computes_a_high_priority_prompt_runs_nothing_lower() -> None:
    """Low-priority streams decoding, a high-priority prompt arrives: its prefill step holds
    neither their decodes nor a low prompt beside it (the step is its time to first token);
    the step after, everyone runs again."""
    scheduler = make(max_num_batched_tokens=32, max_num_seqs=4)
    scheduler.add_request(request("low-1", 4, max_tokens=10, base=10))
    scheduler.add_request(request("low-2", 4, max_tokens=10, base=20))
    step(scheduler)
    scheduler.add_request(request("high", 6, max_tokens=3, priority=5, base=40))
    scheduler.add_request(request("low-3", 4, max_tokens=3, base=30))
    plan, _ = step(scheduler)
    assert [(s.seq.seq_id, s.num_new_tokens) for s in plan.scheduled] == [("high", 6)]
    plan, _ = step(scheduler)
    assert {s.seq.seq_id for s in plan.scheduled} == {"high", "low-1", "low-2", "low-3"}


def test_a_high_priority_prompt_without_blocks_does_not_stall_the_others() -> None:
    """The head of the queue cannot get its blocks yet: the lower-priority streams that hold
    them keep running (nothing would ever free them otherwise), and it runs once they end."""
    scheduler = make(num_blocks=4, block_size=4, max_num_batched_tokens=32, max_num_seqs=4)
    scheduler.add_request(request("low", 6, max_tokens=4, base=10))  # 2 blocks now, 3 at its end
    step(scheduler)
    scheduler.add_request(request("high", 9, max_tokens=2, priority=5, base=40))  # 3 blocks
    plan, _ = step(scheduler)
    assert [s.seq.seq_id for s in plan.scheduled] == ["low"]
    finished = []
    for _ in range(20):
        if not scheduler.has_unfinished():
            break
        finished += [s.seq_id for s in step(scheduler)[1]]
    assert finished == ["low", "high"]
