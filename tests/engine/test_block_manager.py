"""Block manager: exact block ids, prefix hits, eviction order, integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelship.engine import block_manager as bm_module
from modelship.engine.block_manager import BlockManager
from modelship.engine.sampling_params import SamplingParams
from modelship.engine.sequence import Sequence


def seq(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(name, tokens, SamplingParams(max_tokens=4))


def run_prompt(manager: BlockManager, s: Sequence) -> None:
    """Allocate with the prefix hit, then mark the whole prompt computed."""
    computed = manager.get_computed_blocks(s)
    num_new = s.num_tokens - computed.num_tokens
    assert manager.can_allocate(s, num_new, computed)
    manager.allocate(s, num_new, computed)
    s.num_computed_tokens += num_new
    manager.cache_full_blocks(s)


def test_allocation_order_and_tail_first_free() -> None:
    manager = BlockManager(num_blocks=6, block_size=4)
    a = seq(list(range(10)), "a")  # 3 blocks: two full, one partial
    run_prompt(manager, a)
    assert a.block_table == [0, 1, 2]
    b = seq(list(range(100, 105)), "b")
    run_prompt(manager, b)
    assert b.block_table == [3, 4]
    manager.free(a)
    # partial (unhashed) block 2 goes to the front; then the tail of the prefix before its head
    assert list(manager.free_queue) == [2, 5, 1, 0]
    manager.check_integrity()


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)), "a")
    run_prompt(manager, a)
    b = seq([*list(range(8)), 50, 51, 52], "b")
    computed = manager.get_computed_blocks(b)
    assert computed.block_ids == [0, 1] and computed.num_tokens == 8
    run_prompt(manager, b)
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert manager.blocks[0].ref_count == 2
    assert (manager.prefix_queries, manager.prefix_hits) == (10 + 11, 8)
    manager.check_tables([a, b])
    manager.check_integrity()


def test_hit_never_covers_the_last_token() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    run_prompt(manager, seq(list(range(8)), "a"))
    again = seq(list(range(8)), "b")
    computed = manager.get_computed_blocks(again)
    assert computed.num_tokens == 4  # one token is always left to compute


def test_freed_cached_blocks_are_reused_then_evicted_lru() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")
    run_prompt(manager, a)  # blocks 0 [1,2], 1 [3,4] cached; 2 partial
    manager.free(a)
    assert list(manager.free_queue) == [2, 3, 1, 0]
    b = seq([1, 2, 3, 4, 9], "b")
    assert manager.get_computed_blocks(b).block_ids == [0, 1]  # still cached while free
    c = seq([7, 7, 7, 7, 7, 7, 7], "c")  # needs 4 blocks: evicts in queue order
    run_prompt(manager, c)
    assert c.block_table == [2, 3, 1, 0]
    assert manager.get_computed_blocks(b).block_ids == []
    manager.check_integrity()


def test_hash_collision_is_caught_by_token_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 42)
    manager = BlockManager(num_blocks=4, block_size=2)
    run_prompt(manager, seq([1, 2, 3], "a"))
    other = seq([8, 9, 3], "b")  # same (fake) hash, different tokens
    assert manager.get_computed_blocks(other).num_tokens == 0


def test_can_allocate_counts_free_hit_blocks() -> None:
    manager = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")
    run_prompt(manager, a)
    manager.free(a)
    b = seq([1, 2, 3, 4, 6, 7], "b")  # hits 2 free blocks, needs 1 more: 3 in all
    computed = manager.get_computed_blocks(b)
    assert manager.can_allocate(b, 2, computed)
    c = seq([1, 2, 3, 4, 6, 7, 8, 9], "c")  # would need 4 blocks
    assert not manager.can_allocate(c, 4, manager.get_computed_blocks(c))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.booleans()), max_size=40))
def test_integrity_under_random_operations(ops) -> None:
    manager = BlockManager(num_blocks=12, block_size=4)
    live: list[Sequence] = []
    for n, (prefix_kind, length, do_free) in enumerate(ops):
        if do_free and live:
            manager.free(live.pop(0))
        else:
            tokens = [prefix_kind] * 5 + list(range(length))
            s = seq(tokens, f"s{n}")
            computed = manager.get_computed_blocks(s)
            num_new = s.num_tokens - computed.num_tokens
            if manager.can_allocate(s, num_new, computed):
                manager.allocate(s, num_new, computed)
                s.num_computed_tokens += num_new
                manager.cache_full_blocks(s)
                live.append(s)
        manager.check_integrity()
        manager.check_tables(live)
    for s in live:
        manager.free(s)
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks
