"""Block manager: exact block ids, prefix hits, eviction order, integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelship.engine import block_manager as bm_module
from modelship.engine.block_manager import BlockManager
from modelship.engine.sampling_params import SamplingParams
from modelship.engine.sequence import Sequence


def seq(tokens: list[int], name: str = "s", salt: str | None = None) -> Sequence:
    return Sequence(name, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


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


def test_different_salts_never_share_blocks_and_the_same_salt_does() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(10))  # two full blocks, then a partial one
    a = seq(prompt, "a", salt="tenant:alpha")
    run_prompt(manager, a)
    assert a.block_table == [0, 1, 2]

    b = seq(prompt, "b", salt="tenant:beta")  # the same tokens, another tenant
    assert manager.get_computed_blocks(b).num_tokens == 0
    run_prompt(manager, b)
    assert b.block_table == [3, 4, 5] and b.num_cached_tokens == 0
    assert manager.get_computed_blocks(seq(prompt, "u")).num_tokens == 0  # nor unsalted

    a2 = seq([*prompt[:8], 99, 98], "a2", salt="tenant:alpha")
    computed = manager.get_computed_blocks(a2)
    assert computed.block_ids == [0, 1] and computed.num_tokens == 8
    run_prompt(manager, a2)
    assert a2.block_table[:2] == [0, 1] and a2.num_cached_tokens == 8
    # Every hash of the chain differs, not only the first block's.
    assert not set(a.block_hashes) & set(b.block_hashes)
    assert a2.block_hashes == a.block_hashes
    manager.check_tables([a, b, a2])
    manager.check_integrity()

    for s in (a, b, a2):
        manager.free(s)
    b2 = seq(prompt, "b2", salt="tenant:beta")  # freed but still cached: beta's own blocks
    assert manager.get_computed_blocks(b2).block_ids == [3, 4]


def test_the_salt_root_is_the_same_in_every_process() -> None:
    assert bm_module.root_hash(None) is None
    assert bm_module.root_hash("tenant:alpha") == 0xA6098CB4A2DF18C9  # sha256, not hash(str)
    assert bm_module.root_hash("tenant:alpha") != bm_module.root_hash("tenant:beta")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([None, "x", "y"]), st.integers(0, 1), st.integers(1, 9)),
        max_size=30,
    )
)
def test_blocks_are_only_ever_shared_within_one_salt(ops) -> None:
    manager = BlockManager(num_blocks=40, block_size=4)
    live: list[Sequence] = []
    owner: dict[int, str | None] = {}  # block id -> the salt of the sequence that filled it
    for n, (salt, prefix_kind, length) in enumerate(ops):
        s = seq([prefix_kind] * 6 + list(range(length)), f"s{n}", salt)
        computed = manager.get_computed_blocks(s)
        assert all(owner[b] == salt for b in computed.block_ids)
        num_new = s.num_tokens - computed.num_tokens
        if not manager.can_allocate(s, num_new, computed):
            manager.free(live.pop(0))
            continue
        manager.allocate(s, num_new, computed)
        for block_id in s.block_table[len(computed.block_ids) :]:
            owner[block_id] = salt
        s.num_computed_tokens += num_new
        manager.cache_full_blocks(s)
        live.append(s)
    for one in live:
        for other in live:
            if one.cache_salt != other.cache_salt:
                assert not set(one.block_table) & set(other.block_table)
    manager.check_tables(live)
    manager.check_integrity()


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


def test_window_frees_blocks_before_it_head_first_and_keeps_them_cached() -> None:
    """Window 5, blocks of 2: after 8 computed tokens the next query (position 8) sees
    4..8, so blocks 0 and 1 (positions 0..3) go back, hashed; a later sequence with the
    same prefix still hits them."""
    manager = BlockManager(num_blocks=8, block_size=2, window=5)
    a = seq(list(range(8)), "a")
    run_prompt(manager, a)
    assert a.block_table == [0, 1, 2, 3]
    manager.free_outside_window(a)
    assert a.block_table == [bm_module.FREED, bm_module.FREED, 2, 3]
    assert list(manager.free_queue) == [4, 5, 6, 7, 1, 0]  # hashed: evicted last, head last
    manager.check_tables([a])
    manager.check_integrity()
    freed = bm_module.FREED
    # decode: next query at 9 sees 5..9, block 2 (4..5) is still needed; at 10 it is not
    for token, table in ((8, [freed, freed, 2, 3, 4]), (9, [freed, freed, freed, 3, 4])):
        a.append_token(token)
        manager.allocate(a, 1)
        a.num_computed_tokens += 1
        manager.cache_full_blocks(a)
        manager.free_outside_window(a)
        assert a.block_table == table
    assert list(manager.free_queue) == [5, 6, 7, 1, 0, 2]
    b = seq([*range(4), 70, 71, 72], "b")
    assert manager.get_computed_blocks(b).block_ids == [0, 1]  # still in the cache
    run_prompt(manager, b)
    manager.free_outside_window(b)  # next query at 7 sees 3..7: block 0 goes back again
    assert b.block_table == [freed, 1, 5, 6]
    manager.check_tables([a, b])
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 8
    manager.check_integrity()


def test_without_a_window_nothing_is_freed_early() -> None:
    manager = BlockManager(num_blocks=8, block_size=2)
    a = seq(list(range(8)), "a")
    run_prompt(manager, a)
    manager.free_outside_window(a)
    assert a.block_table == [0, 1, 2, 3]
    assert manager.max_blocks_held(100, 16) == 50
    windowed = BlockManager(num_blocks=8, block_size=2, window=5)
    assert windowed.max_blocks_held(100, 16) == 11  # (5 - 1 + 16) / 2 + 1
    assert windowed.max_blocks_held(6, 16) == 3
