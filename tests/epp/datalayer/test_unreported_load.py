"""The EPP's account of what it sent and no load report covers yet, and the scorers reading it."""

from __future__ import annotations

from kvswitch.engine.base import EngineLoadSnapshot
from kvswitch.engine.kv_events import load_record
from kvswitch.epp.contracts import InferenceRequest, ParsedBody
from kvswitch.epp.datalayer import Datalayer, Endpoint, EndpointSpec, Metrics
from kvswitch.epp.framework import PluginHandle
from kvswitch.epp.kvindex import (
    BlocksStored,
    KvBlockIndex,
    KvEventBatchView,
    LoadRecord,
    StoredBlock,
    batch_from_proto,
)
from kvswitch.epp.plugins.kv_cache_utilization_scorer import KvCacheUtilizationScorer
from kvswitch.epp.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvswitch.epp.plugins.prefix_index import PrefixMatch, uncached_tokens
from kvswitch.epp.plugins.queue_scorer import QueueScorer
from kvswitch.protocol import common_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(transit: float = 0.005) -> tuple[Datalayer, Clock, Endpoint]:
    clock = Clock()
    datalayer = Datalayer(clock=clock, transit=transit)
    (endpoint,), _ = datalayer.set_endpoints([EndpointSpec("e:1")])
    return datalayer, clock, endpoint


def push(datalayer: Datalayer, *, age: float = 0.0, waiting: int = 0) -> None:
    datalayer.push("e:1", running=0, waiting=waiting, kv_usage=0.0, waiting_tokens=0, ttl=2.5,
                   age=age)


def test_a_report_covers_what_was_sent_before_it_was_sampled() -> None:
    datalayer, clock, e = setup()
    datalayer.record_sent(e, 1000)
    clock.now += 0.010
    datalayer.record_sent(e, 300)
    clock.now += 0.010
    datalayer.record_sent(e, 50)
    assert (e.unreported_requests, e.unreported_tokens) == (3, 1350)
    clock.now += 0.001
    # Sampled 12 ms ago: after the first send + transit, before the second + transit.
    push(datalayer, age=0.012)
    assert (e.unreported_requests, e.unreported_tokens) == (2, 350)
    # Sampled now: the last send is only 1 ms old, inside the proxy's hop: not covered yet.
    push(datalayer)
    assert (e.unreported_requests, e.unreported_tokens) == (1, 50)
    clock.now += 0.005
    push(datalayer)
    assert (e.unreported_requests, e.unreported_tokens) == (0, 0)


def test_a_record_older_than_its_ttl_counts_as_ttl_old() -> None:
    datalayer, clock, e = setup()
    datalayer.record_sent(e, 10)
    clock.now += 10.0
    push(datalayer, age=3600.0)  # an engine clock far behind: still bounded by the TTL
    assert e.unreported_requests == 0
    datalayer.record_sent(e, 10)
    push(datalayer, age=-5.0)  # ahead: taken as sampled now (the send is inside the hop)
    assert e.unreported_requests == 1


def test_a_poll_covers_what_was_sent_before_it_started() -> None:
    datalayer, clock, e = setup(transit=0.0)
    datalayer.record_sent(e, 10)
    started = clock.now
    clock.now += 0.002
    datalayer.record_sent(e, 20)  # during the poll: the engine may not have had it
    datalayer.update("e:1", Metrics(updated_at=started))
    assert (e.unreported_requests, e.unreported_tokens) == (1, 20)


def record(timestamp: float) -> LoadRecord:
    snapshot = EngineLoadSnapshot(running=1, waiting=2, waiting_uncached_tokens=300,
                                  used_blocks=1, total_blocks=10, block_size=16, max_running=8,
                                  gen_throughput=0.0, cache_hit_rate=0.0)
    message = common_pb2.KvEventBatch(sequence_number=1, timestamp=timestamp,
                                      load=load_record(snapshot, 1, load_only=True, full=False))
    batch = batch_from_proto(KvEventBatchView.FromString(message.SerializeToString()))
    assert batch.load is not None and batch.load.timestamp == timestamp
    return batch.load


def test_a_pushed_record_is_as_old_as_its_lag_beyond_the_fastest() -> None:
    datalayer, clock, e = setup()
    scorer = PrecisePrefixCacheScorer("p", KvBlockIndex(16), PluginHandle(datalayer))
    engine_offset = 5000.0  # the engine's clock reads 5,000 s ahead of the datalayer's
    scorer._pushed_load("e:1", record(clock.now + engine_offset))  # delivered at once
    datalayer.record_sent(e, 7)  # at 100.0: covered by a sample taken at 101.0
    clock.now += 1.2
    datalayer.record_sent(e, 9)  # at 101.2: not covered
    clock.now += 0.3
    scorer._pushed_load("e:1", record(101.0 + engine_offset))  # arrives 0.5 s late
    assert (e.unreported_requests, e.unreported_tokens) == (1, 9)
    assert (e.metrics.waiting, e.metrics.waiting_tokens) == (2, 300)
    scorer._pushed_load("e:1", record(clock.now + engine_offset))
    assert e.unreported_requests == 0


def test_uncached_tokens_subtract_the_picked_endpoints_match() -> None:
    request = InferenceRequest("r", "grpc", "/g", ParsedBody(prompt_token_ids=(1,) * 100))
    match = PrefixMatch(tuple(range(6)), {"a:1": 4}, 16)
    assert uncached_tokens(request, match, "a:1") == 100 - 64
    assert uncached_tokens(request, match, "b:1") == 100
    assert uncached_tokens(request, None, "a:1") == 100


def test_load_scorers_add_the_unreported_account() -> None:
    datalayer, _, _ = setup()
    a, b = Endpoint(EndpointSpec("a:1")), Endpoint(EndpointSpec("b:1"))
    a.metrics = Metrics(waiting=1, kv_usage=0.2, max_tokens=10_000)
    b.metrics = Metrics(waiting=0, kv_usage=0.2, max_tokens=10_000)
    request = InferenceRequest("r", "grpc", "/g", ParsedBody(prompt_token_ids=(1,) * 16))
    assert QueueScorer("q").score(request, {}, [a, b]) == [0.0, 1.0]
    datalayer.record_sent(b, 2000)
    datalayer.record_sent(b, 2000)
    assert QueueScorer("q").score(request, {}, [a, b]) == [1.0, 0.0]  # 1 waiting < 0 + 2 sent
    free = KvCacheUtilizationScorer("k").score(request, {}, [a, b])
    assert free[0] == 0.8 and abs(free[1] - 0.4) < 1e-12


def test_prefill_in_progress_ends_when_the_prompts_last_block_is_stored() -> None:
    now = [0.0]
    index = KvBlockIndex(16, clock=lambda: now[0])
    index.add_endpoint("e:1")
    prompt = list(range(64))  # 4 blocks
    hashes = index.block_hashes(prompt)
    index.speculate("e:1", hashes, 2.0)
    index.await_prefill("e:1", hashes, 64, 30.0)
    assert index.pending_prefill("e:1") == 64
    # The first chunk's blocks: still prefilling.
    index.apply("e:1", [BlocksStored(tuple(StoredBlock.of(i, prompt[i * 16:(i + 1) * 16])
                                           for i in range(2)), None, 16)])
    assert index.pending_prefill("e:1") == 64
    # The last block, after its speculative entry expired: the prefill is over all the same.
    now[0] = 5.0
    index.expire()
    index.apply("e:1", [BlocksStored(tuple(StoredBlock.of(i, prompt[i * 16:(i + 1) * 16])
                                           for i in range(2, 4)), 1, 16)])
    assert index.pending_prefill("e:1") == 0 and index.pending == {"e:1": 0}


def _store(index: KvBlockIndex, prompt: list[int], first: int, end: int) -> None:
    """The engine stores blocks first..end-1 of `prompt` (one chunk's step)."""
    index.apply("e:1", [BlocksStored(
        tuple(StoredBlock.of(1000 + i, prompt[i * 16:(i + 1) * 16]) for i in range(first, end)),
        1000 + first - 1 if first else None, 16)])


def test_a_chunked_prefill_counts_what_is_left_as_its_chunks_are_stored() -> None:
    index = KvBlockIndex(16)
    index.add_endpoint("e:1")
    prompt = list(range(200 * 16))  # 200 blocks: checkpoints at blocks 63, 127 and 191
    hashes = index.block_hashes(prompt)
    index.await_prefill("e:1", hashes, 3200, 30.0)
    _store(index, prompt, 0, 100)  # a chunk past block 63: blocks 64-199 are left
    assert index.pending_prefill("e:1") == 136 * 16 and index.prefilling_requests("e:1") == 1
    _store(index, prompt, 100, 120)  # no checkpoint in it: the count stays
    assert index.pending_prefill("e:1") == 136 * 16
    _store(index, prompt, 120, 195)  # past block 191
    assert index.pending_prefill("e:1") == 8 * 16
    _store(index, prompt, 195, 200)  # the last block: the prefill is over
    assert index.pending_prefill("e:1") == 0 and index.prefilling_requests("e:1") == 0


def test_progress_starts_past_the_held_blocks_and_is_shared_by_the_same_prompt() -> None:
    index = KvBlockIndex(16)
    index.add_endpoint("e:1")
    prompt = list(range(200 * 16))
    hashes = index.block_hashes(prompt)
    _store(index, prompt, 0, 70)  # held: 70 blocks, so the first checkpoint is block 127
    first = index.await_prefill("e:1", hashes, 130 * 16, 30.0, held=70)
    index.await_prefill("e:1", hashes, 130 * 16, 30.0, held=70)  # the same prompt again
    _store(index, prompt, 70, 120)
    assert index.pending_prefill("e:1") == 2 * 130 * 16
    _store(index, prompt, 120, 130)
    assert index.pending_prefill("e:1") == 2 * 72 * 16  # at most 72 blocks left each
    index.end_prefill(first)  # one ends (its answer came first): its share of what is left
    assert index.pending_prefill("e:1") == 72 * 16 and index.prefilling_requests("e:1") == 1


def test_an_ended_count_leaves_the_checkpoints_a_longer_prompt_shares() -> None:
    index = KvBlockIndex(16)
    index.add_endpoint("e:1")
    prompt = list(range(200 * 16))
    hashes = index.block_hashes(prompt)
    shorter = index.await_prefill("e:1", hashes[:150], 2400, 30.0)  # its first 150 blocks
    index.await_prefill("e:1", hashes, 3200, 30.0)  # shares checkpoints 63 and 127
    index.end_prefill(shorter)
    assert index.pending_prefill("e:1") == 3200
    _store(index, prompt, 0, 100)
    assert index.pending_prefill("e:1") == 136 * 16


def test_prefill_never_stored_expires_and_a_clear_drops_it() -> None:
    now = [0.0]
    index = KvBlockIndex(16, clock=lambda: now[0])
    index.add_endpoint("e:1")
    index.await_prefill("e:1", [111], 500, 30.0)
    index.await_prefill("e:1", [111], 200, 30.0)  # the same prompt twice
    now[0] = 20.0
    index.await_prefill("e:1", [222], 50, 30.0)
    assert index.pending_prefill("e:1") == 750
    now[0] = 31.0
    index.await_prefill("e:1", [333], 1, 30.0)  # (expiry is checked on the next call)
    assert index.pending_prefill("e:1") == 51 and index.pending == {"e:1": 51}
    index.clear("e:1")
    assert index.pending_prefill("e:1") == 0 and not index.pending


def test_estimated_ttft_counts_prefill_the_engine_admitted() -> None:
    from kvswitch.epp.plugins.estimated_ttft_scorer import create

    a, b = Endpoint(EndpointSpec("a:1")), Endpoint(EndpointSpec("b:1"))
    # Both report nothing waiting; a has 8,000 tokens of admitted prompts still prefilling.
    pending = {"a:1": 8000, "b:1": 0}
    scorer = create("t", {"runningRequestTokens": 0}, PluginHandle(Datalayer()))
    request = InferenceRequest("r", "grpc", "/g", ParsedBody(prompt_token_ids=(1,) * 1600))
    match = PrefixMatch(tuple(range(100)), {"a:1": 100}, 16, pending)
    scores = scorer.score(request, {"prefix-index": match}, [a, b])
    assert scores[1] == 1.0 and scores[0] < 1.0  # 8,000 queued > 1,600 saved
    pending["a:1"] = 1000
    scores = scorer.score(request, {"prefix-index": match}, [a, b])
    assert scores[0] == 1.0 and scores[1] < 1.0  # 1,000 queued < 1,600 saved


def test_no_prefill_is_awaited_where_events_cannot_be_indexed() -> None:
    index = KvBlockIndex(16)
    index.add_endpoint("e:1")
    index.await_prefill("e:1", [111], 500, 30.0)
    index.set_indexed("e:1", False)  # another block size: no BlockStored will ever end it
    assert index.pending_prefill("e:1") == 0
    index.await_prefill("e:1", [222], 500, 30.0)
    assert index.pending_prefill("e:1") == 0
    index.set_indexed("e:1", True)
    index.await_prefill("e:1", [222], 500, 30.0)
    assert index.pending_prefill("e:1") == 500
