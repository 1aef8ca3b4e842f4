"""KvBlockIndex and SequenceTracker: exact event sequences in, exact match lengths / verdicts
out."""

from __future__ import annotations

import random

from kvswitch.epp.kvindex import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    EventBatch,
    KvBlockIndex,
    KvEventBatchView,
    SequenceTracker,
    SnapshotInfo,
    StoredBlock,
    Verdict,
    batch_from_proto,
    chained_block_hashes,
    root_hash,
)
from kvswitch.epp.kvindex.subscriber import KvEventSubscriber
from kvswitch.protocol import common_pb2
from kvswitch.protocol.packed import PackedTokenIds, pack_token_ids

B = 4


def chain(tokens: list[int], start_hash: int = 1000, parent: int | None = None,
          first_block: int = 0) -> BlocksStored:
    """A stored event for the full blocks of `tokens`, engine hashes start_hash + block index."""
    blocks = tuple(StoredBlock.of(start_hash + first_block + i, tokens[i * B:(i + 1) * B])
                   for i in range(len(tokens) // B))
    return BlocksStored(blocks, parent, B)


PROMPT = list(range(100, 120))  # 5 blocks of 4


def test_match_counts_leading_blocks_per_endpoint() -> None:
    index = KvBlockIndex(B)
    index.apply("a", [chain(PROMPT[:12])])  # 3 blocks
    index.apply("b", [chain(PROMPT)])  # 5 blocks
    index.add_endpoint("c")
    hashes = index.block_hashes(PROMPT + [1, 2])  # the partial trailing block is not hashed
    assert len(hashes) == 5
    assert index.match(hashes) == {"a": 3, "b": 5, "c": 0}
    assert index.match_tokens(PROMPT[:10]) == {"a": 8, "b": 8, "c": 0}
    assert index.match(hashes, ["b", "zzz"]) == {"b": 5, "zzz": 0}


def test_block_hashes_take_any_sequence_and_only_full_blocks() -> None:
    # Each block's ids are hashed in their packed wire form, the form KV events carry them in.
    expected, parent = [], root_hash()
    for i in range(5):
        parent = hash((parent, pack_token_ids(PROMPT[i * B:(i + 1) * B])))
        expected.append(parent)
    assert (chained_block_hashes(PROMPT + [7], B) == chained_block_hashes(tuple(PROMPT), B)
            == expected)
    assert chained_block_hashes(PackedTokenIds.of(PROMPT), B) == expected
    assert chained_block_hashes(PROMPT[:B - 1], B) == []
    index = KvBlockIndex(B)
    index.apply("a", [chain(PROMPT)])
    # Nobody holds the first block: every named endpoint matches 0.
    assert index.match(chained_block_hashes([9] * 8, B), ["a", "b"]) == {"a": 0, "b": 0}
    assert index.match([], ["a"]) == {"a": 0}


def test_hash_is_chained_content_not_engine_hash() -> None:
    index = KvBlockIndex(B)
    # Two engines with different hash functions store the same content.
    index.apply("a", [chain(PROMPT, start_hash=1)])
    index.apply("b", [chain(PROMPT, start_hash=777)])
    assert index.match(index.block_hashes(PROMPT)) == {"a": 5, "b": 5}
    # Same block content at another position (different parent) does not match.
    other = PROMPT[4:8] + PROMPT[:4]
    assert index.match(index.block_hashes(other)) == {"a": 0, "b": 0}


def test_stored_with_parent_continues_the_chain() -> None:
    index = KvBlockIndex(B)
    index.apply("a", [chain(PROMPT[:8])])  # engine hashes 1000, 1001
    index.apply("a", [chain(PROMPT[8:16], parent=1001, first_block=2)])
    assert index.match(index.block_hashes(PROMPT)) == {"a": 4}


def test_unknown_parent_is_not_placed() -> None:
    index = KvBlockIndex(B)
    stats = index.apply("a", [chain(PROMPT[8:16], parent=424242, first_block=2)])
    assert (stats.stored, stats.unplaced) == (0, 2)
    assert index.num_blocks("a") == 0
    assert index.match(index.block_hashes(PROMPT)) == {"a": 0}


def test_removal_breaks_the_leading_run() -> None:
    index = KvBlockIndex(B)
    index.apply("a", [chain(PROMPT)])
    stats = index.apply("a", [BlocksRemoved((1002,))])  # the third block
    assert stats.removed == 1
    assert index.match(index.block_hashes(PROMPT)) == {"a": 2}
    index.apply("a", [BlocksRemoved((1003, 1004, 999999))])  # unknown hash: ignored
    assert index.num_blocks("a") == 2


def test_removal_of_one_copy_keeps_the_other() -> None:
    index = KvBlockIndex(B)
    index.apply("a", [chain(PROMPT[:8])])
    index.apply("a", [chain(PROMPT[:8])])  # a second physical copy, same engine hashes
    index.apply("a", [BlocksRemoved((1000, 1001))])
    assert index.match(index.block_hashes(PROMPT)) == {"a": 2}
    index.apply("a", [BlocksRemoved((1000, 1001))])
    assert index.match(index.block_hashes(PROMPT)) == {"a": 0}


def test_same_content_under_two_engine_hashes_stays_until_both_go() -> None:
    """An engine may cache equal tokens under two hashes (its hash covers more than tokens):
    one content block, held until the last engine hash naming it is removed; clearing drops
    it at once."""
    index = KvBlockIndex(B)
    index.apply("a", [chain(PROMPT[:8])])
    index.apply("a", [chain(PROMPT[:8], start_hash=2000)])
    assert index.num_blocks("a") == 2
    index.apply("a", [BlocksRemoved((1000, 1001))])
    assert (index.match(index.block_hashes(PROMPT)), index.num_blocks("a")) == ({"a": 2}, 2)
    index.apply("a", [BlocksRemoved((2001,))])
    assert (index.match(index.block_hashes(PROMPT)), index.num_blocks("a")) == ({"a": 1}, 1)
    index.apply("a", [chain(PROMPT[:8], start_hash=3000), CacheCleared()])
    assert (index.match(index.block_hashes(PROMPT)), index.num_blocks("a")) == ({"a": 0}, 0)
    index.apply("a", [chain(PROMPT[:4])])
    assert (index.match(index.block_hashes(PROMPT)), index.num_blocks("a")) == ({"a": 1}, 1)


def test_remove_then_store_in_one_batch_keeps_order() -> None:
    index = KvBlockIndex(B)
    index.apply("a", [chain(PROMPT[:4])])
    index.apply("a", [BlocksRemoved((1000,)), chain(PROMPT[:8])])
    assert index.match(index.block_hashes(PROMPT)) == {"a": 2}


def test_clear_only_touches_one_endpoint() -> None:
    index = KvBlockIndex(B)
    index.apply("a", [chain(PROMPT)])
    index.apply("b", [chain(PROMPT)])
    assert index.apply("a", [CacheCleared()]).cleared
    assert index.match(index.block_hashes(PROMPT)) == {"a": 0, "b": 5}
    index.remove_endpoint("b")
    assert index.match(index.block_hashes(PROMPT)) == {"a": 0}
    index.apply("c", [chain(PROMPT[:4])])  # reuses b's bit
    assert index.match(index.block_hashes(PROMPT)) == {"a": 0, "c": 1}


def test_match_tables_follow_endpoints_joining_and_leaving() -> None:
    """`match` keeps a bit table per tuple of names: a bit reused by a new endpoint must never
    count for the endpoint that left, asked for by the same names."""
    index = KvBlockIndex(B)
    hashes = index.block_hashes(PROMPT)
    index.apply("a", [chain(PROMPT[:8])])
    index.apply("b", [chain(PROMPT)])
    assert index.match(hashes, ["a", "b", "c"]) == {"a": 2, "b": 5, "c": 0}
    index.remove_endpoint("b")
    index.apply("c", [chain(PROMPT[:4])])  # takes b's bit
    assert index.match(hashes, ["a", "b", "c"]) == {"a": 2, "b": 0, "c": 1}
    assert index.match(hashes, ["c", "a"]) == {"c": 1, "a": 2}
    index.apply("b", [chain(PROMPT[:12])])  # back, with a new bit
    assert index.match(hashes, ["a", "b", "c"]) == {"a": 2, "b": 3, "c": 1}


def test_match_held_leaves_out_the_endpoints_holding_nothing() -> None:
    index = KvBlockIndex(B)
    index.apply("a", [chain(PROMPT[:8])])
    index.apply("b", [chain(PROMPT)])
    index.add_endpoint("c")
    hashes = index.block_hashes(PROMPT)
    assert index.match_held(hashes, iter(["c", "b", "zzz", "a"])) == {"a": 2, "b": 5}
    assert index.match_held(hashes, ("c", "zzz")) == {}
    assert index.match_held(index.block_hashes([7] * 8), ("a", "b")) == {}  # a new prefix
    assert index.match_held([], ("a",)) == {}


def test_block_size_mismatch_is_never_indexed() -> None:
    index = KvBlockIndex(B)
    event = BlocksStored((StoredBlock.of(1, PROMPT[:8]),), None, 8)
    assert index.apply("a", [event]).unplaced == 1
    assert index.match(index.block_hashes(PROMPT)) == {"a": 0}


def test_namespaces_do_not_share_blocks() -> None:
    index = KvBlockIndex(B)
    blocks = chain(PROMPT).blocks
    index.apply("a", [BlocksStored(blocks, None, B, ("lora1", ""))])
    assert index.match(index.block_hashes(PROMPT)) == {"a": 0}
    assert index.match(index.block_hashes(PROMPT, ("lora1", ""))) == {"a": 5}


def batch(seq: int, *events: object, load_only: bool = False,
          snapshot: SnapshotInfo | None = None) -> EventBatch:
    return EventBatch(seq, tuple(events), load_only=load_only,  # type: ignore[arg-type]
                      snapshot=snapshot)


def test_tracker_in_order_duplicates_and_load_only() -> None:
    t = SequenceTracker()
    assert t.resume_from() == 0
    t.stream_opened(0)
    assert t.receive(batch(0, load_only=True)) is Verdict.LOAD_ONLY
    assert [t.receive(batch(s)) for s in (0, 1, 2, 3)] == [Verdict.APPLY] * 4
    assert t.receive(batch(3, load_only=True)) is Verdict.LOAD_ONLY
    assert t.receive(batch(2)) is Verdict.DUPLICATE
    assert (t.last, t.partial, t.resume_from()) == (3, False, 4)


def test_tracker_gap_then_resume_then_lost_history() -> None:
    t = SequenceTracker()
    t.stream_opened(1)
    assert t.receive(batch(1)) is Verdict.APPLY
    assert t.receive(batch(3)) is Verdict.GAP  # a live stream skipped 2
    assert t.resume_from() == 2 and t.gaps == 1
    t.stream_opened(2)
    assert t.receive(batch(2)) is Verdict.APPLY  # the engine still held it
    assert t.receive(batch(3)) is Verdict.APPLY
    t.stream_opened(4)
    assert t.receive(batch(9)) is Verdict.RESET  # history 4..8 is gone
    assert (t.last, t.partial, t.resets) == (9, True, 1)


def test_tracker_restart_and_snapshot() -> None:
    t = SequenceTracker()
    t.stream_opened(1)
    for s in (1, 2, 3, 4, 5):
        t.receive(batch(s))
    t.stream_opened(6)
    assert t.receive(batch(1)) is Verdict.RESET  # numbering began again: a new engine life
    assert (t.last, t.partial) == (1, False)
    t.stream_opened(2)
    snap = SnapshotInfo(0, 2, 0)
    assert t.receive(batch(40, CacheCleared(), snapshot=snap)) is Verdict.RESET
    assert t.receive(batch(41, snapshot=SnapshotInfo(1, 2, 0))) is Verdict.APPLY
    assert (t.last, t.partial) == (41, False)


def test_fresh_stream_starting_late_is_partial() -> None:
    t = SequenceTracker()
    t.stream_opened(0)
    assert t.receive(batch(7)) is Verdict.APPLY
    assert t.partial
    t = SequenceTracker()
    t.stream_opened(0)
    assert t.receive(batch(1)) is Verdict.APPLY  # numbering from 1 is complete
    assert not t.partial


def test_subscriber_handle_resets_the_index_on_lost_history() -> None:
    index = KvBlockIndex(B)
    sub = KvEventSubscriber("a", index)
    sub.tracker.stream_opened(1)
    assert sub.handle(batch(1, chain(PROMPT))) is Verdict.APPLY
    assert index.match(index.block_hashes(PROMPT)) == {"a": 5}
    sub.tracker.stream_opened(2)
    assert sub.handle(batch(5, chain(PROMPT[:4], start_hash=50))) is Verdict.RESET
    assert index.match(index.block_hashes(PROMPT)) == {"a": 1}
    assert sub.handle(batch(7, chain(PROMPT))) is Verdict.GAP  # not applied
    assert index.match(index.block_hashes(PROMPT)) == {"a": 1}


def test_batch_from_proto_keeps_order_and_filters_tiers() -> None:
    msg = common_pb2.KvEventBatch(sequence_number=7)
    stored = msg.events.add().stored
    stored.parent_block_hash = 5
    stored.blocks.add(block_hash=11, token_ids=[1, 2, 3, 4], block_size=4)
    msg.events.add().removed.block_hashes.extend([3, 4])
    msg.events.add().cleared.SetInParent()
    cpu = msg.events.add().stored
    cpu.tier = common_pb2.KV_CACHE_TIER_HOST
    cpu.blocks.add(block_hash=12, token_ids=[1, 2, 3, 4], block_size=4)
    msg.load.running_requests = 3
    msg.load.waiting_uncached_tokens = 0
    got = batch_from_proto(KvEventBatchView.FromString(msg.SerializeToString()))
    assert got.sequence_number == 7 and not got.load_only
    assert got.events == (
        BlocksStored((StoredBlock.of(11, (1, 2, 3, 4)),), 5, 4),
        BlocksRemoved((3, 4)),
        CacheCleared(),
    )
    assert got.load is not None and got.load.running == 3
    assert got.load.waiting_uncached_tokens == 0 and got.load.cache_hit_rate is None



def test_batch_from_proto_keeps_only_device_local_group_0_events() -> None:
    msg = common_pb2.KvEventBatch(sequence_number=1)
    for n, fields in enumerate([
            {"tier": common_pb2.KV_CACHE_TIER_DEVICE, "group_idx": 0},  # explicit: kept
            {"tier": common_pb2.KV_CACHE_TIER_HOST},
            {"group_idx": 1},
            {"locality": common_pb2.KV_CACHE_LOCALITY_REMOTE}]):
        stored = msg.events.add().stored
        for name, value in fields.items():
            setattr(stored, name, value)
        stored.blocks.add(block_hash=n, token_ids=[n], block_size=1)
        removed = msg.events.add().removed
        for name, value in fields.items():
            if name != "locality":  # (KvBlocksRemoved has one too, not filtered on)
                setattr(removed, name, value)
        removed.block_hashes.append(n)
    events = batch_from_proto(KvEventBatchView.FromString(msg.SerializeToString())).events
    assert events[:2] == (BlocksStored(((0, b"\x00"),), None, 1), BlocksRemoved((0,)))
    assert events[2:] == (BlocksRemoved((3,)),)  # the remote-locality removal: kept as before


def test_long_prompts_many_endpoints() -> None:
    # 16 endpoints, each holding the 6000-token system prompt of its own group.
    rng = random.Random(0)
    index = KvBlockIndex(16)
    prompts = [[rng.randrange(150_000) for _ in range(7200)] for _ in range(16)]
    for e, prompt in enumerate(prompts):
        blocks = tuple(StoredBlock.of(e * 10_000 + i, prompt[i * 16:(i + 1) * 16])
                       for i in range(6000 // 16))
        index.apply(f"10.0.0.{e}:8000", [BlocksStored(blocks, None, 16)])
    for i in range(16):
        result = index.match(index.block_hashes(prompts[i]))
        assert result[f"10.0.0.{i}:8000"] == 375
        assert sorted(result.values()) == [0] * 15 + [375]


def test_block_hashes_function_matches_method() -> None:
    assert chained_block_hashes(PROMPT, B) == KvBlockIndex(B).block_hashes(PROMPT)
    assert chained_block_hashes(PROMPT[:3], B) == []



def test_random_events_agree_with_a_plain_model() -> None:
    """Stores (from any block, so some are unplaced; some again: extra copies), removals and
    clears over 3 endpoints sharing prompts: matches and block counts equal a plain model
    (per endpoint: engine hash -> copies, and -> own hash or None when unplaced)."""
    rnd = random.Random(7)
    prompts = [[rnd.randrange(50) for _ in range(B * 6)] for _ in range(4)]
    prompts += [p[:B * 3] + [rnd.randrange(50) for _ in range(B * 3)] for p in prompts[:2]]
    owns = [chained_block_hashes(p, B) for p in prompts]
    engines = [[hash(("engine", i, k)) for k in range(6)] for i in range(len(prompts))]
    index = KvBlockIndex(B)
    copies: dict[str, dict[int, int]] = {e: {} for e in "abc"}
    placed_as: dict[str, dict[int, int | None]] = {e: {} for e in "abc"}
    for _ in range(3000):
        endpoint, p = rnd.choice("abc"), rnd.randrange(len(prompts))
        count, own_of = copies[endpoint], placed_as[endpoint]
        roll = rnd.random()
        if roll < 0.6:
            start, end = sorted(rnd.sample(range(7), 2))
            parent = engines[p][start - 1] if start else None
            blocks = tuple(StoredBlock.of(engines[p][k], prompts[p][k * B:(k + 1) * B])
                           for k in range(start, end))
            index.apply(endpoint, [BlocksStored(blocks, parent, B)])
            placed = parent is None or own_of.get(parent) is not None
            for k in range(start, end):
                h = engines[p][k]
                count[h] = count.get(h, 0) + 1
                if own_of.get(h) is None:
                    own_of[h] = owns[p][k] if placed else None
        elif roll < 0.95:
            gone = rnd.sample(engines[p], 3)
            index.apply(endpoint, [BlocksRemoved(tuple(gone))])
            for h in gone:
                if h in count:
                    count[h] -= 1
                    if not count[h]:
                        del count[h], own_of[h]
        else:
            index.apply(endpoint, [CacheCleared()])
            count.clear()
            own_of.clear()
        held = {e: {o for o in placed_as[e].values() if o is not None} for e in "abc"}
        for e in "abc":
            assert index.num_blocks(e) == len(held[e])
        for hashes in owns:
            expected = {e: next((i for i, h in enumerate(hashes) if h not in held[e]),
                                len(hashes)) for e in "abc"}
            assert index.match(hashes, "abc") == expected
            assert index.match_held(hashes, "abc") == {e: n for e, n in expected.items() if n}
