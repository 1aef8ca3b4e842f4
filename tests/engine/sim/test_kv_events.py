"""KV event batches: stored (parent hash + token ids), removed, cleared, replay, flush."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import pytest

from kvswitch.engine.base import EngineLoadSnapshot, KvEventBatchData, QueuedPrompt
from kvswitch.engine.sim import SimEngine
from kvswitch.engine.sim.events import (
    LOAD_PUSH_SECONDS,
    PUSH_INTERVAL_SECONDS,
    QUEUED_PROMPTS,
    QUEUED_TOKENS,
    KvEventLog,
    net_events,
    next_push_at,
)
from kvswitch.engine.sim.kv_cache import KvBlockStored

from .conftest import collect, make_engine, request

PROMPT = list(range(3000, 3040))  # 2 full blocks + 8


def held(engine: SimEngine) -> list[KvEventBatchData]:
    return list(engine._events.history)


async def drain(engine: SimEngine, start: int = 0) -> list[KvEventBatchData]:
    """The batches held from `start`, once the pending window is out, without waiting for live
    ones."""
    await asyncio.sleep(engine._events.coalesce_seconds + 0.01)
    out = []
    it = engine.kv_events(start)
    while True:
        try:
            out.append(await asyncio.wait_for(it.__anext__(), 0.05))
        except (TimeoutError, StopAsyncIteration):
            break
    await it.aclose()  # type: ignore[attr-defined]
    return out


async def test_stored_blocks_chain_and_carry_tokens(engine: SimEngine) -> None:
    await collect(engine.generate(request("a", PROMPT, max_tokens=20)))
    batches = await drain(engine)
    stored = [b for batch in batches for b in batch.stored]
    # Prompt blocks 0-1, then block 2 (prompt tail + output) and block 3 once full of output.
    assert [s.token_ids for s in stored[:2]] == [tuple(PROMPT[:16]), tuple(PROMPT[16:32])]
    assert stored[2].token_ids == tuple(PROMPT[32:40] + PROMPT[:8])
    assert stored[0].parent_block_hash is None
    assert [s.parent_block_hash for s in stored[1:]] == [s.block_hash for s in stored[:-1]]
    assert [b.sequence_number for b in batches] == list(range(len(batches)))
    assert all(b.load is not None and b.load.total_blocks == 64 for b in batches)


async def test_replay_from_a_sequence_number_then_follow_live(engine: SimEngine) -> None:
    await collect(engine.generate(request("a", PROMPT, max_tokens=3)))
    everything = await drain(engine)
    assert await drain(engine, 2) == everything[2:]
    follower = engine.kv_events(len(everything))
    nxt = asyncio.ensure_future(follower.__anext__())
    await asyncio.sleep(0)
    assert not nxt.done()
    await collect(engine.generate(request("b", [9] * 40, max_tokens=3)))
    live = await nxt
    assert live.sequence_number == len(everything) and live.stored
    await follower.aclose()  # type: ignore[attr-defined]


async def test_eviction_emits_removed() -> None:
    e = make_engine()
    await e.start()
    first = [1] * 17 + [2] * 480  # ~31 blocks: two such prompts and the pool must evict
    await collect(e.generate(request("a", first, max_tokens=1)))
    first_hashes = {b.block_hash for batch in await drain(e) for b in batch.stored}
    await collect(e.generate(request("b", [3] * 900, max_tokens=1)))
    removed = {h for batch in await drain(e) for h in batch.removed}
    await e.stop()
    assert removed and removed <= first_hashes


async def test_flush_clears_the_cache_and_emits_cleared(engine: SimEngine) -> None:
    await collect(engine.generate(request("a", PROMPT, max_tokens=2)))
    before = len(held(engine))
    assert await engine.flush_cache() is True
    batches = held(engine)[before:]
    assert len(batches) == 1 and batches[0].cleared
    again = await collect(engine.generate(request("b", PROMPT, max_tokens=2)))
    assert again[0].cached_tokens == 0


async def test_flush_refused_while_requests_run(engine: SimEngine) -> None:
    it = engine.generate(request("a", PROMPT, max_tokens=500))
    await it.__anext__()
    assert await engine.flush_cache() is False
    await it.aclose()  # type: ignore[attr-defined]


def test_a_batch_never_both_stores_and_removes_a_hash() -> None:
    s1, s2 = KvBlockStored(1, None, (1,)), KvBlockStored(2, 1, (2,))
    assert net_events([s1, 1, s2]) == ((s2,), (1,))  # removed last: gone
    assert net_events([1, s1]) == ((s1,), ())  # re-stored last: present


async def test_history_is_bounded_and_replay_starts_at_the_oldest() -> None:
    log = KvEventLog(capacity=3)
    for t in range(5):
        log.publish(float(t))
    log.close()
    assert [b.sequence_number async for b in log.follow(0)] == [2, 3, 4]


async def test_history_holds_at_most_max_events_block_events() -> None:
    log = KvEventLog(capacity=100, coalesce_seconds=0, max_events=5)
    blocks = [KvBlockStored(h, None, (h,)) for h in range(10)]
    log.publish(0.0, blocks[:2])  # 0: 2 events
    log.publish(1.0, blocks[2:4] + [0])  # 1: 3 events
    log.publish(2.0, blocks[4:6])  # 2: 2 events -> 7 held, batch 0 goes
    assert [b.sequence_number for b in log.history] == [1, 2]
    assert log.held_events == 5
    log.publish(3.0, blocks[6:10] + [1, 2, 3])  # 3: 7 events, over the bound: kept as newest
    assert [b.sequence_number for b in log.history] == [3]
    assert log.held_events == 7
    log.publish(4.0)  # the next batch, even one without events, lets it go
    log.close()
    assert [b.sequence_number async for b in log.follow(0)] == [4]


async def test_dropping_the_oldest_batch_by_capacity_keeps_the_count_right() -> None:
    log = KvEventLog(capacity=2, coalesce_seconds=0, max_events=100)
    for t in range(4):
        log.publish(float(t), [KvBlockStored(t, None, (t,)), 1000 + t])
    assert [b.sequence_number for b in log.history] == [2, 3]
    assert log.held_events == 4


async def test_steps_inside_the_window_are_merged_into_one_batch() -> None:
    log = KvEventLog(coalesce_seconds=0.05)
    a, b, c = (KvBlockStored(h, None, (h,)) for h in (1, 2, 3))
    first = log.publish(100.0, [a])
    assert first is not None and first.sequence_number == 0  # a quiet engine: at once
    assert log.publish(100.01, [b]) is None
    assert log.publish(100.02, [c, 2]) is None  # b removed again: only its removal remains
    assert len(log.history) == 1
    await asyncio.sleep(0.1)
    merged = log.history[-1]
    assert (merged.sequence_number, merged.timestamp) == (1, 100.02)
    assert (merged.stored, merged.removed) == ((c,), (2,))
    assert log.publish(100.2, [a]) is not None  # the window is over: at once again


async def test_a_clear_drops_pending_events_and_is_published_at_once() -> None:
    log = KvEventLog(coalesce_seconds=10.0)
    a, b = KvBlockStored(1, None, (1,)), KvBlockStored(2, None, (2,))
    log.publish(100.0, [a])
    assert log.publish(100.01, [b]) is None
    cleared = log.publish(100.02, [a], cleared=True)
    assert cleared is not None and cleared.cleared and cleared.stored == (a,)
    assert [x.sequence_number for x in log.history] == [0, 1]
    assert log.publish(100.03, [b]) is None
    log.close()  # publishes what is pending before ending the followers
    assert [x.stored async for x in log.follow(2)] == [(b,)]


def snapshot(running: int, waiting: int, used: int = 0) -> EngineLoadSnapshot:
    return EngineLoadSnapshot(running, waiting, 0, used, 100, 16, 256, 0.0, 0.0)


async def test_load_moves_and_going_idle_wait_for_the_window() -> None:
    log = KvEventLog(coalesce_seconds=0.05)
    log.publish(100.0, load=snapshot(16, 0))
    assert log.publish(100.01, load=snapshot(15, 1)) is None
    assert log.publish(100.02, load=snapshot(16, 12)) is None  # a queue builds up: it waits
    assert log.publish(100.03, load=snapshot(0, 0)) is None  # idle: it waits too
    assert [b.sequence_number for b in log.history] == [0]
    await asyncio.sleep(0.1)  # the window's timer publishes the latest load
    assert [b.sequence_number for b in log.history] == [0, 1]
    assert log.history[-1].load == snapshot(0, 0)
    assert log.publish(100.2, load=snapshot(1, 0)) is not None  # a new window opens at once


def test_the_engine_flag_sets_the_coalescing_window() -> None:
    import argparse

    from kvswitch.engine.cli import add_arguments, sim_config_kwargs
    from kvswitch.engine.sim import SimConfig, SimEngine

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv, window in (([], 0.05), (["--kv-events-coalesce-ms", "0"], 0.0),
                         (["--kv-events-coalesce-ms", "20"], 0.02)):
        engine = SimEngine(SimConfig(**sim_config_kwargs(parser.parse_args(argv))))
        assert engine._events.coalesce_seconds == pytest.approx(window)


async def next_item(follower: AsyncIterator[KvEventBatchData]) -> KvEventBatchData:
    return await asyncio.wait_for(follower.__anext__(), 5.0)


async def test_an_arrival_pushes_the_load_to_every_follower_once_per_push_window() -> None:
    log = KvEventLog(coalesce_seconds=60.0, load_push_seconds=0.005)
    log.publish(100.0, load=snapshot(1, 0))  # opens a window that outlasts the test
    a, b = log.follow(0), log.follow(0)
    assert (await next_item(a)).sequence_number == (await next_item(b)).sequence_number == 0
    assert log.followers == 2
    for _ in range(3):  # a burst: one push carries it
        log.arrived()
    first_a, first_b = await next_item(a), await next_item(b)
    assert first_a.load_only and first_a is first_b and first_a.queued == ()
    assert log.load_pushes == 1
    log.arrived()  # the next arrival after the push gets a push of its own
    second = await next_item(a)
    assert second.load_only and second is not first_a and await next_item(b) is second
    assert log.load_pushes == 2 and len(log.history) == 1  # pushes are not in the history
    log.close()
    assert [x async for x in a] == [] and [x async for x in b] == []
    assert log.followers == 0


def test_a_push_comes_its_delay_after_an_arrival_but_an_interval_after_the_last_push() -> None:
    assert next_push_at(10.0, -math.inf, 0.001) == pytest.approx(10.001)
    assert next_push_at(10.0, 10.0 - PUSH_INTERVAL_SECONDS, 0.001) == pytest.approx(10.001)
    assert next_push_at(10.0, 9.999, 0.001) == pytest.approx(9.999 + PUSH_INTERVAL_SECONDS)
    assert next_push_at(10.0, 9.999, 0.02) == pytest.approx(10.02)


async def test_pushes_keep_the_interval_while_arrivals_keep_coming() -> None:
    log = KvEventLog(coalesce_seconds=60.0, load_push_seconds=0.001)
    log.publish(100.0, load=snapshot(1, 0))
    a, b = log.follow(0), log.follow(0)
    await next_item(a)
    await next_item(b)
    loop = asyncio.get_running_loop()
    arrived = loop.time()
    log.arrived()
    assert (await next_item(a)).load_only
    first = loop.time()
    log.arrived()  # at once: this push waits for the interval, not just the delay
    assert (await next_item(a)).load_only
    second = loop.time()
    assert first - arrived >= 0.001 - 1e-4
    assert second - first >= PUSH_INTERVAL_SECONDS - 1e-4
    log.close()


async def test_no_push_with_one_follower_or_with_pushes_off() -> None:
    log = KvEventLog(coalesce_seconds=60.0, load_push_seconds=0.005)
    log.publish(100.0)
    one = log.follow(0)
    await next_item(one)
    log.arrived()  # one EPP counts its own sends: nothing to push
    assert log._push_timer is None
    off = KvEventLog(coalesce_seconds=60.0, load_push_seconds=0.0)
    off.publish(100.0)
    followers = [off.follow(0), off.follow(0)]
    for follower in followers:
        await next_item(follower)
    off.arrived()
    assert off._push_timer is None
    for follower in (one, *followers):
        await follower.aclose()  # type: ignore[attr-defined]


async def two_followers(log: KvEventLog) -> tuple[AsyncIterator[KvEventBatchData], ...]:
    """Two followers (several EPPs: the log pushes) past the batch each starts with."""
    log.publish(100.0)
    followers = log.follow(0), log.follow(0)
    for follower in followers:
        await next_item(follower)
    return followers


async def test_a_push_carries_the_full_blocks_of_the_prompts_queued_since_the_last() -> None:
    log = KvEventLog(coalesce_seconds=60.0, load_push_seconds=0.005, block_size=4)
    a, b = await two_followers(log)
    log.arrived("r1", list(range(10)))  # two full blocks and a partial one
    log.arrived("r2", [7, 7, 7])  # no full block: nothing to announce
    log.arrived("r3", list(range(8)))
    push = await next_item(a)
    assert push.queued == (QueuedPrompt("r1", tuple(range(8))), QueuedPrompt("r3", tuple(range(8))))
    assert await next_item(b) is push
    for request_id in ("r4", "r5"):
        log.arrived(request_id, list(range(4)))
        assert (await next_item(a)).queued == (QueuedPrompt(request_id, (0, 1, 2, 3)),)
    # b fell two pushes behind: it gets both, in order.
    assert [(await next_item(b)).queued[0].request_id for _ in range(2)] == ["r4", "r5"]
    for follower in (a, b):
        await follower.aclose()  # type: ignore[attr-defined]


async def test_a_push_leaves_out_a_request_past_its_prefill() -> None:
    prefilling = {"r1", "r2"}
    log = KvEventLog(coalesce_seconds=60.0, load_push_seconds=0.005, block_size=4,
                     prefilling=prefilling.__contains__)
    a, b = await two_followers(log)
    log.arrived("r1", list(range(4)))
    log.arrived("r2", list(range(4)))
    prefilling.discard("r2")  # past its prefill before the push: its blocks come in a batch
    assert [q.request_id for q in (await next_item(a)).queued] == ["r1"]
    for follower in (a, b):
        await follower.aclose()  # type: ignore[attr-defined]


async def test_a_push_announces_a_bounded_number_of_prompts_and_tokens() -> None:
    log = KvEventLog(coalesce_seconds=60.0, load_push_seconds=0.005, block_size=16)
    a, b = await two_followers(log)
    for i in range(QUEUED_PROMPTS + 5):
        log.arrived(f"r{i}", [1] * 16)
    assert len((await next_item(a)).queued) == QUEUED_PROMPTS
    await next_item(b)
    log.arrived("huge", [1] * (QUEUED_TOKENS + 16))  # past the token bound: not announced
    log.arrived("small", [1] * 16)  # still fits
    assert [q.request_id for q in (await next_item(a)).queued] == ["small"]
    for follower in (a, b):
        await follower.aclose()  # type: ignore[attr-defined]


async def test_an_announced_request_that_ends_in_its_prefill_is_withdrawn_on_a_push() -> None:
    prefilling = {"r1", "r2", "r3"}
    log = KvEventLog(coalesce_seconds=60.0, load_push_seconds=0.005, block_size=4,
                     prefilling=prefilling.__contains__)
    a, b = await two_followers(log)
    for request_id in ("r1", "r2"):
        log.arrived(request_id, list(range(4)))
    assert [q.request_id for q in (await next_item(a)).queued] == ["r1", "r2"]
    await next_item(b)
    # r1 is cancelled while queued; r2 ends after its prefill (its blocks are stored).
    log.ended("r1")
    prefilling.discard("r2")
    log.ended("r2")
    push = await next_item(a)
    assert push.withdrawn == ("r1",) and push.queued == ()
    assert await next_item(b) is push
    # Announced once, withdrawn once; a request no push announced is never withdrawn.
    log.ended("r1")
    log.arrived("r3", list(range(4)))
    log.ended("r3")
    prefilling.discard("r3")
    assert (await next_item(a)).withdrawn == ()
    for follower in (a, b):
        await follower.aclose()  # type: ignore[attr-defined]


async def test_withdrawals_are_bounded_per_push_and_the_rest_follow() -> None:
    ids = [f"r{i}" for i in range(QUEUED_PROMPTS + 3)]
    log = KvEventLog(coalesce_seconds=60.0, load_push_seconds=0.005, block_size=4,
                     prefilling=lambda request_id: True)
    a, b = await two_followers(log)
    announced = []
    for start in (0, QUEUED_PROMPTS):  # announced on two pushes (the same bound)
        for request_id in ids[start:start + QUEUED_PROMPTS]:
            log.arrived(request_id, list(range(4)))
        announced += [q.request_id for q in (await next_item(a)).queued]
    assert announced == ids
    for request_id in ids:
        log.ended(request_id)
    first, second = await next_item(a), await next_item(a)
    assert first.withdrawn == tuple(ids[:QUEUED_PROMPTS])
    assert second.withdrawn == tuple(ids[QUEUED_PROMPTS:])
    for follower in (a, b):
        await follower.aclose()  # type: ignore[attr-defined]


def test_the_engine_flag_sets_the_load_push_delay() -> None:
    import argparse

    from kvswitch.engine.cli import add_arguments, sim_config_kwargs
    from kvswitch.engine.sim import SimConfig, SimEngine

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv, delay in (([], LOAD_PUSH_SECONDS), (["--load-push-ms", "0"], 0.0),
                        (["--load-push-ms", "2"], 0.002)):
        engine = SimEngine(SimConfig(**sim_config_kwargs(parser.parse_args(argv))))
        assert engine._events.load_push_seconds == pytest.approx(delay)
