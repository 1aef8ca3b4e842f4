"""The EPP's account of what it sent and no load report covers yet, and the scorers reading it."""

from __future__ import annotations

import time

from kvswitch.engine.base import EngineLoadSnapshot
from kvswitch.engine.kv_events import load_record
from kvswitch.epp.datalayer import Datalayer, Endpoint, EndpointSpec, Metrics
from kvswitch.epp.framework import PluginHandle
from kvswitch.epp.kvindex import KvEventBatchView, PrefixIndex, batch_from_proto
from kvswitch.epp.kvindex.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvswitch.epp.plugins.kv_cache_utilization_scorer import KvCacheUtilizationScorer
from kvswitch.epp.plugins.prefix_index import PrefixMatch, uncached_tokens
from kvswitch.epp.plugins.queue_scorer import QueueScorer
from kvswitch.epp.request import InferenceRequest, ParsedBody
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


def test_pushed_records_carry_the_engine_timestamp_as_age() -> None:
    snapshot = EngineLoadSnapshot(running=1, waiting=2, waiting_uncached_tokens=300,
                                  used_blocks=1, total_blocks=10, block_size=16, max_running=8,
                                  gen_throughput=0.0, cache_hit_rate=0.0)
    sampled = time.time() - 0.5
    message = common_pb2.KvEventBatch(sequence_number=1, timestamp=sampled,
                                      load=load_record(snapshot, 1, load_only=True, full=False))
    batch = batch_from_proto(KvEventBatchView.FromString(message.SerializeToString()))
    assert batch.load is not None and batch.load.timestamp == sampled
    datalayer, clock, e = setup()
    scorer = PrecisePrefixCacheScorer("p", PrefixIndex(16), PluginHandle(datalayer))
    # The record arrives at 101.5, sampled ~0.5 s before: at ~101.0.
    datalayer.record_sent(e, 7)  # at 100.0: covered
    clock.now += 1.2
    datalayer.record_sent(e, 9)  # at 101.2: not covered
    clock.now += 0.3
    scorer._pushed_load("e:1", batch.load)
    assert (e.unreported_requests, e.unreported_tokens) == (1, 9)
    assert (e.metrics.waiting, e.metrics.waiting_tokens) == (2, 300)


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
