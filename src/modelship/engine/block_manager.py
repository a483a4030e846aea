"""The paged KV cache's bookkeeping: blocks, block tables, prefix caching.

Blocks are created once, up front. A block is *used* (ref_count > 0, held by one or more
sequences' block tables) or *free* (ref_count == 0, in `free_queue`). A free block may
still be *cached*: it holds a full block of tokens whose hash is registered, so a later
sequence with the same prefix can take it back instead of recomputing it. `free_queue`
is in eviction order (front first): blocks without a hash go to the front, and a
sequence's blocks are freed tail first, so the tail of a prefix is evicted before its head.

Hashes are chained: a full block's hash covers its tokens and its parent's hash, so equal
hashes mean equal prefixes; the tokens are compared on a hit anyway, so a hash collision
can cost a miss but never a wrong answer. A sequence's `cache_salt` (its tenant's cache
namespace) stands in for the first block's parent, so every hash of the chain depends on
it: sequences with different salts never share a block, whatever their tokens, and a
tenant's time to first token says nothing about another tenant's prompts.

Sliding windows (`window`, set when every layer of the model attends to its last `window`
positions only, as Mistral v0.1): a query at position p reads p - window + 1 .. p, and a
running sequence's next query is at `num_computed_tokens`, so a block wholly before that
query's window is read by no later step of the sequence. `free_outside_window` hands such
blocks back while the sequence runs, head first, and leaves -1 in their place in the block
table (the table stays indexed by position; attention never reads those entries). A
returned full block keeps its hash like any freed block: another sequence with the same
prefix still takes it from the cache until it is evicted. For models with some global layer
(Gemma) `window` is None: every block stays until the sequence ends.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from modelship.engine.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    # Tuples of ints hash the same in every process (no string hash salting involved).
    return hash((parent_hash, token_ids))


def root_hash(cache_salt: str | None, lora_key: str | None = None) -> int | None:
    """The parent hash of a sequence's first block: None without a salt or LoRA adapter,
    else an int derived from them (sha256, so it is the same in every process, like
    `hash_block`). `lora_key` is the adapter's name + content hash (`LoRAAdapter.key`): a
    prefix computed with one adapter is never a hit for another, or for the base model."""
    if cache_salt is None and lora_key is None:
        return None
    data = b"modelship-cache-salt\0" + (cache_salt or "").encode()
    if lora_key is not None:
        data += b"\0modelship-lora\0" + lora_key.encode()
    digest = hashlib.sha256(data).digest()
    return int.from_bytes(digest[:8], "little")


def seq_root_hash(seq: Sequence) -> int | None:
    return root_hash(seq.cache_salt, seq.lora.key if seq.lora is not None else None)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # set while the block is registered as cached


@dataclass(frozen=True)
class ComputedBlocks:
    """A prefix-cache hit: cached blocks covering the first `num_tokens` tokens."""

    block_ids: list[int]
    hashes: list[int]
    num_tokens: int


NO_HIT = ComputedBlocks([], [], 0)
FREED = -1  # a block-table entry whose block went back to the pool (outside the window)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: int | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        if window is not None and window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up (vLLM counts tokens)
        self.prefix_hits = 0

    # Asking (no state changes) ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens holds at once, running at most
        `max_step_tokens` tokens a step: all of them, or with a window the blocks of the
        window before a step's first token and of the step's tokens."""
        need = self.blocks_needed(num_tokens)
        if self.window is None:
            return need
        return min(need, self.blocks_needed(self.window - 1 + max_step_tokens) + 1)

    def get_computed_blocks(self, seq: Sequence) -> ComputedBlocks:
        """The longest cached prefix of `seq`'s tokens, in full blocks. Does not modify state.

        At least one token is always left to compute, so the model produces logits. A
        sequence that wants prompt logprobs computes its whole prompt: they need every
        position's hidden state.
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return NO_HIT
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent = seq_root_hash(seq)
        block_ids: list[int] = []
        hashes: list[int] = []
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_hash = hash_block(parent, tokens)
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            block_ids.append(block_id)
            hashes.append(block_hash)
            parent = block_hash
        return ComputedBlocks(block_ids, hashes, len(block_ids) * self.block_size)

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, computed: ComputedBlocks = NO_HIT
    ) -> bool:
        """Whether `allocate(seq, num_new_tokens, computed)` would succeed."""
        num_computed = computed.num_tokens if computed.block_ids else seq.num_computed_tokens
        have = len(seq.block_table) + len(computed.block_ids)
        need = self.blocks_needed(num_computed + num_new_tokens) - have
        # Hit blocks that are free now leave the free queue when taken.
        taken_from_free = sum(1 for b in computed.block_ids if self.blocks[b].ref_count == 0)
        return need <= len(self.free_queue) - taken_from_free

    # Committing --------------------------------------------------------------------------------
    def allocate(
        self, seq: Sequence, num_new_tokens: int, computed: ComputedBlocks = NO_HIT
    ) -> None:
        """Grow `seq.block_table` to cover its computed tokens plus `num_new_tokens`.

        On a sequence's first allocation, `computed` (from `get_computed_blocks`) is taken:
        its blocks are shared and `seq.num_computed_tokens` jumps to the end of the hit.
        The caller must have checked `can_allocate`.
        """
        if not seq.block_table:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += computed.num_tokens
            for block_id in computed.block_ids:
                self._take(block_id)
                seq.block_table.append(block_id)
            seq.block_hashes = list(computed.hashes)
            seq.num_computed_tokens = computed.num_tokens
            seq.num_cached_tokens = computed.num_tokens
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self.free_queue):
            raise RuntimeError(f"allocate without room: need {need}, free {len(self.free_queue)}")
        for _ in range(need):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            seq.block_table.append(block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of `seq`'s blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = seq.block_hashes[i - 1] if i else seq_root_hash(seq)
            block_hash = hash_block(parent, tokens)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[i]]
            if block_hash not in self.hash_to_block and block.hash is None:
                block.hash = block_hash
                block.token_ids = tokens
                self.hash_to_block[block_hash] = block.block_id

    def free_outside_window(self, seq: Sequence) -> None:
        """Hand back the blocks of `seq` wholly before its next query's window (none without
        a window); their table entries become `FREED`. Call after `cache_full_blocks`, so a
        full block is hashed (and reusable from the cache) before it goes."""
        if self.window is None:
            return
        first_seen = seq.num_computed_tokens - self.window + 1  # the next query's first key
        i = max(0, first_seen) // self.block_size - 1  # the last block wholly before it
        # tables are freed head first: walk back to the previous call's last freed entry
        while i >= 0 and seq.block_table[i] != FREED:
            block = self.blocks[seq.block_table[i]]
            seq.block_table[i] = FREED
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None
                if block.hash is None:  # nothing to reuse: evict it first
                    self.free_queue.move_to_end(block.block_id, last=False)
            i -= 1

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the tail blocks of `seq` past the first `num_tokens` tokens' (the slots of
        rejected speculative drafts). Such blocks hold no computed full block: never hashed."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.hash is None, "trimmed a cached block"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None
                self.free_queue.move_to_end(block.block_id, last=False)

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, tail first; cached ones stay reusable until evicted."""
        for block_id in reversed(seq.block_table):
            if block_id == FREED:  # the rest went back already (`free_outside_window`)
                break
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.hash is None:  # nothing to reuse: evict it first
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.block_hashes = []

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_count == 0:
                self._evict(block)

    def check_integrity(self) -> None:
        """free + used == total, ref counts >= 0, the hash map and blocks agree."""
        used = [b for b in self.blocks if b.ref_count > 0]
        assert all(b.ref_count >= 0 for b in self.blocks), "negative ref count"
        assert len(used) + len(self.free_queue) == self.num_blocks, (
            f"used {len(used)} + free {len(self.free_queue)} != total {self.num_blocks}"
        )
        assert all(self.blocks[b].ref_count == 0 for b in self.free_queue), "used block is free"
        for block_hash, block_id in self.hash_to_block.items():
            block = self.blocks[block_id]
            assert block.hash == block_hash, f"block {block_id} hash does not match the map"
            assert block.token_ids is not None and len(block.token_ids) == self.block_size
        hashed = sum(1 for b in self.blocks if b.hash is not None)
        assert hashed == len(self.hash_to_block), "a hashed block is missing from the map"

    def check_tables(self, seqs: list[Sequence]) -> None:
        """Every block's ref count equals the number of block tables holding it."""
        counts = [0] * self.num_blocks
        for seq in seqs:
            for block_id in seq.block_table:
                if block_id != FREED:
                    counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {counts[block.block_id]} tables"
            )

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _evict(self, block: Block) -> None:
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block.block_id:
                del self.hash_to_block[block.hash]
            block.hash = None
            block.token_ids = None
