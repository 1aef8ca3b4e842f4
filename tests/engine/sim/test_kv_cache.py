"""The paged KV cache: hash chaining, prefix hits, refcounts, LRU eviction, events, reset."""

from __future__ import annotations

from kvswitch.engine.base import KvBlockStored, SamplingOptions
from kvswitch.engine.sim.kv_cache import ROOT_HASH, KvCacheManager, block_hash
from kvswitch.engine.sim.request import SimSequence

BS = 4


def seq(tokens: list[int], name: str = "s") -> SimSequence:
    return SimSequence(name, 0, tokens, SamplingOptions(), 16)


def admit(kv: KvCacheManager, s: SimSequence) -> int:
    """Admit like the scheduler: take the cached prefix, allocate the rest; returns hit tokens."""
    kv.hash_full_blocks(s)
    hits = kv.find_cached_prefix(s)
    n_hit = len(hits) * kv.block_size
    assert kv.allocate_slots(s, s.num_tokens - n_hit, hits)
    s.num_computed_tokens = s.num_tokens
    return n_hit


def stored(kv: KvCacheManager) -> list[KvBlockStored]:
    return [e for e in kv.pool.drain_events()[0] if isinstance(e, KvBlockStored)]


def test_hashes_chain_on_the_parent() -> None:
    kv = KvCacheManager(16, BS)
    a = seq([1, 2, 3, 4, 9, 9, 9, 9, 0])
    b = seq([5, 6, 7, 8, 9, 9, 9, 9, 0])  # same second block after a different first block
    kv.hash_full_blocks(a)
    kv.hash_full_blocks(b)
    assert a.block_hashes[0] == block_hash(ROOT_HASH, (1, 2, 3, 4))
    assert a.block_hashes[1] == block_hash(a.block_hashes[0], (9, 9, 9, 9))
    assert a.block_hashes[1] != b.block_hashes[1]
    admit(kv, a)
    assert admit(kv, b) == 0  # the identical second block is not shared


def test_prefix_hit_shares_blocks_and_leaves_a_token_to_compute() -> None:
    kv = KvCacheManager(16, BS)
    a = seq(list(range(10)))  # 2 full blocks + 2 tokens
    admit(kv, a)
    b = seq(list(range(10)), "b")
    assert admit(kv, b) == 8
    assert b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]
    assert [kv.pool.ref_cnt[x] for x in a.blocks[:2]] == [2, 2]
    kv.free(a)
    assert kv.pool.ref_cnt[b.blocks[0]] == 1  # still b's
    # A full hit on an exact multiple of the block size stops a block short: the last prompt
    # token is always computed (its logits give the first output token).
    c = seq(list(range(8)), "c")
    assert admit(kv, c) == 4


def test_stored_events_carry_parent_and_tokens() -> None:
    kv = KvCacheManager(16, BS)
    a = seq(list(range(9)))
    admit(kv, a)
    ev = stored(kv)
    assert [e.token_ids for e in ev] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert ev[0].parent_block_hash is None
    assert ev[1].parent_block_hash == ev[0].block_hash == a.block_hashes[0]
    # A hit stores nothing new.
    admit(kv, seq(list(range(9)), "b"))
    assert stored(kv) == []


def test_lru_evicts_least_recently_freed_tail_first() -> None:
    kv = KvCacheManager(4, BS)
    a, b = seq([1] * 8, "a"), seq([2] * 8, "b")
    admit(kv, a)
    kv.free(a)  # free queue: a's tail, then a's head (tail is evicted first)
    admit(kv, b)
    kv.free(b)
    kv.pool.drain_events()
    c = seq([3] * 12, "c")
    admit(kv, c)  # needs 3 blocks: evicts a1, a0, then b1
    removed = [e for e in kv.pool.drain_events()[0] if isinstance(e, int)]
    assert removed == [a.block_hashes[1], a.block_hashes[0], b.block_hashes[1]]
    assert kv.pool.lookup(b.block_hashes[0]) is not None
    assert kv.pool.lookup(a.block_hashes[0]) is None


def test_a_hit_refreshes_a_block_in_the_lru() -> None:
    kv = KvCacheManager(4, BS)
    a, b = seq([1] * 4 + [0], "a"), seq([2] * 4 + [0], "b")
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    again = seq([1] * 4 + [0], "a2")
    assert admit(kv, again) == 4  # a's block reused: now most recently used
    kv.free(again)
    kv.pool.drain_events()
    admit(kv, seq([3] * 8, "c"))  # two evictions: b's cached block goes before a's
    removed = [e for e in kv.pool.drain_events()[0] if isinstance(e, int)]
    assert b.block_hashes[0] in removed and a.block_hashes[0] not in removed


def test_allocation_fails_without_enough_free_blocks() -> None:
    kv = KvCacheManager(2, BS)
    a = seq([1] * 8, "a")
    admit(kv, a)
    b = seq([2] * 4, "b")
    kv.hash_full_blocks(b)
    assert not kv.allocate_slots(b, 4)
    assert b.blocks == [] and kv.pool.num_free == 0


def test_reset_refused_in_use_then_clears() -> None:
    kv = KvCacheManager(4, BS)
    a = seq([1] * 8)
    admit(kv, a)
    assert kv.pool.reset() is False
    kv.free(a)
    assert kv.pool.reset() is True
    events, cleared = kv.pool.drain_events()
    assert cleared and events == []
    assert kv.pool.lookup(a.block_hashes[0]) is None
