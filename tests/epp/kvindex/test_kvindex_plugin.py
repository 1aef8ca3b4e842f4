"""precise-prefix-cache-scorer: scores from the KV-event index, for token and text prompts."""

from __future__ import annotations

import pytest

from kvswitch.epp.contracts import InferenceRequest, ParsedBody
from kvswitch.epp.datalayer import Datalayer, Endpoint, EndpointSpec
from kvswitch.epp.framework import PluginHandle
from kvswitch.epp.plugins.precise_prefix_cache_scorer import TYPE, create
from kvswitch.tokenization import load_tokenizer
from tests.support.kvblocks import stored


def test_scores_are_matched_fraction_for_tokens_and_text() -> None:
    assert TYPE == "precise-prefix-cache-scorer"
    scorer = create("p", {"blockSize": 16}, PluginHandle(Datalayer()))
    tokenizer = load_tokenizer(None)
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
    ids = tokenizer.encode(text)
    full = len(ids) // 16
    scorer.index.apply("a:1", [stored(ids)])
    scorer.index.apply("b:1", [stored(ids[:32])])
    endpoints = [Endpoint(EndpointSpec(a)) for a in ("a:1", "b:1", "c:1")]
    for body in (ParsedBody(prompt_token_ids=tuple(ids)), ParsedBody(prompt_text=text)):
        request = InferenceRequest("r", "grpc", "/x", body)
        state: dict[str, object] = {}
        scorer.produce(request, state, endpoints)
        assert scorer.score(request, state, endpoints) == [1.0, 2 / full, 0.0]


def test_pushed_load_records_reach_the_endpoint_metrics() -> None:
    from kvswitch.epp.kvindex import LoadRecord

    datalayer = Datalayer()
    datalayer.set_endpoints([EndpointSpec("a:1")])
    scorer = create("p", {"blockSize": 16, "tokenizer": "none"}, PluginHandle(datalayer))
    record = LoadRecord(running=2, waiting=5, waiting_uncached_tokens=3000, token_usage=0.25,
                        gen_throughput=0.0, max_running=256, sample=1)
    scorer.subscriptions.on_load("a:1", record)  # type: ignore[misc]
    m = datalayer.get("a:1").metrics  # type: ignore[union-attr]
    assert (m.running, m.waiting, m.waiting_tokens, m.kv_usage) == (2, 5, 3000, 0.25)


async def test_scheduling_cycles_follow_pool_changes() -> None:
    import asyncio

    datalayer = Datalayer()
    datalayer.set_endpoints([EndpointSpec("a:1")])
    scorer = create("p", {"blockSize": 16, "tokenizer": "none"}, PluginHandle(datalayer))
    synced: list[set[str]] = []
    release = asyncio.Event()
    release.set()

    async def set_endpoints(pool: frozenset[str]) -> None:
        synced.append(set(pool))
        await release.wait()

    scorer.subscriptions.set_endpoints = set_endpoints  # type: ignore[method-assign]
    request = InferenceRequest("r", "grpc", "/x", ParsedBody(prompt_token_ids=tuple(range(32))))

    async def cycle() -> None:
        scorer.produce(request, {}, datalayer.ready())
        await asyncio.sleep(0)

    await cycle()
    await cycle()
    assert synced == [{"a:1"}]
    datalayer.set_endpoints([EndpointSpec("a:1"), EndpointSpec("b:1")])
    await cycle()
    datalayer.set_endpoints([EndpointSpec("a:1"), EndpointSpec("b:1")])  # no change
    await cycle()
    assert synced == [{"a:1"}, {"a:1", "b:1"}]
    # A change while a sync is still running is taken up by a cycle after it finished.
    release.clear()
    datalayer.set_endpoints([EndpointSpec("b:1")])
    await cycle()
    datalayer.set_endpoints([EndpointSpec("c:1")])
    await cycle()
    await cycle()
    assert synced == [{"a:1"}, {"a:1", "b:1"}, {"b:1"}]
    release.set()
    await cycle()
    await cycle()
    assert synced == [{"a:1"}, {"a:1", "b:1"}, {"b:1"}, {"c:1"}]


def long_text(words: int) -> str:
    import random

    rnd = random.Random(words)
    vocabulary = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "in",
                  "the", "gateway", "prefix", "cache"]
    return " ".join(rnd.choice(vocabulary) for _ in range(words))


async def test_a_long_text_is_tokenized_off_the_event_loop_with_the_same_ids() -> None:
    import asyncio

    from kvswitch.epp.plugins.precise_prefix_cache_scorer import TOKENS_KEY
    from kvswitch.tokenization.offload import OFFLOAD_TEXT_CHARS

    scorer = create("p", {"blockSize": 16}, PluginHandle(Datalayer()))
    tokenizer = load_tokenizer(None)
    short, long = long_text(50), long_text(30_000)  # long: ~100 ms of tokenizing
    assert len(short) < OFFLOAD_TEXT_CHARS <= len(long)
    for body in (ParsedBody(prompt_text=short), ParsedBody(prompt_token_ids=(1, 2, 3))):
        assert scorer.prepare(InferenceRequest("r", "grpc", "/x", body), {}) is None
    request = InferenceRequest("r", "grpc", "/x", ParsedBody(prompt_text=long))
    state: dict[str, object] = {}
    pending = scorer.prepare(request, state)
    assert pending is not None
    task = asyncio.ensure_future(pending)
    turns = 0
    while not task.done():  # the loop keeps turning while the text is tokenized
        turns += 1
        await asyncio.sleep(0)
    await task
    assert turns >= 10  # inline, the task would have finished in its first step
    ids = tokenizer.encode(long)
    assert state[TOKENS_KEY] == ids
    # produce uses the prepared ids: the same match as tokenizing inline would give.
    scorer.index.apply("a:1", [stored(ids[:160])])
    endpoints = [Endpoint(EndpointSpec("a:1")), Endpoint(EndpointSpec("b:1"))]
    inline_state: dict[str, object] = {}
    for s in (state, inline_state):
        scorer.produce(request, s, endpoints)
    full = len(ids) // 16
    assert scorer.score(request, state, endpoints) == [10 / full, 0.0]
    assert scorer.score(request, inline_state, endpoints) == [10 / full, 0.0]


async def test_the_router_routes_others_while_a_long_text_is_tokenized() -> None:
    import asyncio

    from kvswitch.epp.config import build_endpoint_picker, static_pool
    from kvswitch.epp.datalayer import Metrics
    from kvswitch.epp.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
    from kvswitch.epp.router import EppRouter
    from kvswitch.launcher import DEFAULT_EPP_CONFIG
    from tests.support.processes import free_port

    addresses = [f"127.0.0.1:{free_port()}" for _ in range(3)]  # nothing listens there
    router = build_endpoint_picker(DEFAULT_EPP_CONFIG, static_pool(addresses)).router
    assert isinstance(router, EppRouter)
    router.datalayer.set_endpoints(router.refresher.discovery.endpoints)  # type: ignore[union-attr]
    router.datalayer.staleness = 1e9
    for address in addresses:
        router.datalayer.update(address, Metrics(updated_at=router.datalayer.clock()))
    scorer = next(p for p in router.scheduler.plugins if isinstance(p, PrecisePrefixCacheScorer))
    text = long_text(30_000)
    ids = load_tokenizer(None).encode(text)
    # The third replica holds most of its prompt (a prefix under half would be copied instead).
    scorer.index.apply(addresses[2], [stored(ids[:len(ids) * 3 // 4 // 16 * 16])])
    # The quick one's prompt is held by the first: it goes there, not where the slow one goes
    # (a request routed and not yet reported counts as queued load).
    scorer.index.apply(addresses[0], [stored((5,) * 64)])
    try:
        slow = asyncio.create_task(router.route(
            InferenceRequest("long", "grpc", "/x", ParsedBody(prompt_text=text)), None))
        await asyncio.sleep(0)  # it has started tokenizing in the worker thread
        quick = await router.route(
            InferenceRequest("tokens", "grpc", "/x", ParsedBody(prompt_token_ids=(5,) * 64)), None)
        assert quick.status == 200 and not slow.done()
        decision = await slow
        assert decision.status == 200 and decision.endpoints[0] == addresses[2]
    finally:
        await scorer.stop()


async def test_an_externally_fed_scorer_opens_no_stream_and_reads_what_it_is_handed() -> None:
    import asyncio

    from kvswitch.epp.kvindex import EventBatch, LoadRecord

    datalayer = Datalayer()
    datalayer.set_endpoints([EndpointSpec("a:1"), EndpointSpec("b:1")])
    scorer = create("p", {"blockSize": 16, "tokenizer": "none"}, PluginHandle(datalayer))
    opened: list[set[str]] = []

    async def set_endpoints(pool: frozenset[str]) -> None:
        opened.append(set(pool))

    scorer.subscriptions.set_endpoints = set_endpoints  # type: ignore[method-assign]
    subscribers = scorer.feed_externally(["a:1", "b:1"])
    assert sorted(subscribers) == ["a:1", "b:1"]
    ids = list(range(48))
    record = LoadRecord(running=1, waiting=4, waiting_uncached_tokens=100, token_usage=0.5,
                        gen_throughput=0.0, max_running=256, sample=1)
    subscribers["a:1"].handle(EventBatch(1, (stored(ids),), load=record))
    request = InferenceRequest("r", "grpc", "/x", ParsedBody(prompt_token_ids=tuple(ids)))
    state: dict[str, object] = {}
    endpoints = list(datalayer.all())
    scorer.produce(request, state, endpoints)
    await asyncio.sleep(0)
    assert opened == []  # the caller feeds the index: no stream of the plugin's own
    scores = dict(zip((e.address for e in endpoints), scorer.score(request, state, endpoints)))
    assert scores == {"a:1": 1.0, "b:1": 0.0}
    m = datalayer.get("a:1").metrics  # type: ignore[union-attr]
    assert (m.running, m.waiting, m.kv_usage) == (1, 4, 0.5)


def test_a_prompt_another_epp_queued_on_an_engine_counts_there_as_this_epps_own_would() -> None:
    from kvswitch.engine.base import QueuedPrompt
    from kvswitch.engine.kv_events import queued_events
    from kvswitch.epp.framework import ProfileResult
    from kvswitch.epp.kvindex import EventBatch, KvEventBatchView, batch_from_proto
    from kvswitch.protocol import common_pb2

    ids = list(range(1, 101))  # six full blocks of 16 and four tokens
    full = 96
    epps = []
    for _ in range(2):
        datalayer = Datalayer()
        datalayer.set_endpoints([EndpointSpec("a:1"), EndpointSpec("b:1")])
        scorer = create("p", {"blockSize": 16, "tokenizer": "none"}, PluginHandle(datalayer))
        epps.append((scorer, scorer.feed_externally(["a:1", "b:1"]), list(datalayer.all())))
    (router, router_feed, endpoints), (other, other_feed, _) = epps
    # The first EPP routes the request to a:1: its own speculative entries and prefill.
    request = InferenceRequest("r1", "grpc", "/x", ParsedBody(prompt_token_ids=tuple(ids),
                                                               request_id="r1"))
    state: dict[str, object] = {}
    router.produce(request, state, endpoints)
    router.pre_request(request, state, ProfileResult("p", (endpoints[0],)))
    assert router.index.pending_prefill("a:1") == full
    assert other.index.match(other.index.block_hashes(ids)) == {"a:1": 0, "b:1": 0}
    # a:1's load push names the queued prompt; it reaches both EPPs, as the wire carries it.
    push = common_pb2.KvEventBatch(
        sequence_number=0, events=queued_events([QueuedPrompt("r1", tuple(ids[:full]))], 16),
        load=common_pb2.EngineLoad(waiting_requests=1, load_only=True))
    batch = batch_from_proto(KvEventBatchView.FromString(push.SerializeToString()))
    assert batch.events == () and len(batch.queued) == 1
    for feed in (router_feed, other_feed):
        feed["a:1"].handle(batch)
    hashes = other.index.block_hashes(ids)
    assert other.index.match(hashes) == {"a:1": 6, "b:1": 0}
    assert other.index.num_speculative("a:1") == 6
    assert other.index.pending_prefill("a:1") == full
    assert router.index.pending_prefill("a:1") == full  # its own: not counted twice
    next_request = InferenceRequest("r2", "grpc", "/x", ParsedBody(prompt_token_ids=tuple(ids)))
    other_state: dict[str, object] = {}
    other.produce(next_request, other_state, endpoints)
    assert other.score(next_request, other_state, endpoints) == [1.0, 0.0]
    # The engine schedules it and stores the blocks: confirmed, and no longer in progress.
    other_feed["a:1"].handle(EventBatch(1, (stored(ids),)))
    assert other.index.num_speculative("a:1") == 0 and other.index.num_blocks("a:1") == 6
    assert other.index.pending_prefill("a:1") == 0


def test_a_withdrawn_prompt_another_epp_queued_stops_counting_there() -> None:
    from kvswitch.engine.base import QueuedPrompt
    from kvswitch.engine.kv_events import queued_events, withdrawn_events
    from kvswitch.epp.kvindex import KvEventBatchView, batch_from_proto
    from kvswitch.protocol import common_pb2

    datalayer = Datalayer()
    datalayer.set_endpoints([EndpointSpec("a:1")])
    scorer = create("p", {"blockSize": 16, "tokenizer": "none"}, PluginHandle(datalayer))
    feed = scorer.feed_externally(["a:1"])["a:1"]

    def push(events: list[common_pb2.KvCacheEvent]) -> None:
        message = common_pb2.KvEventBatch(sequence_number=0, events=events,
                                          load=common_pb2.EngineLoad(load_only=True))
        feed.handle(batch_from_proto(KvEventBatchView.FromString(message.SerializeToString())))

    kept, cancelled = tuple(range(1, 33)), tuple(range(100, 148))  # two and three full blocks
    push(queued_events([QueuedPrompt("kept", kept), QueuedPrompt("cancelled", cancelled)], 16))
    assert scorer.index.pending_prefill("a:1") == len(kept) + len(cancelled)
    # Cancelled while queued: a later push withdraws it (an unknown id changes nothing).
    assert scorer.index.num_speculative("a:1") == 5
    push(withdrawn_events(["cancelled", "never-announced"]))
    assert scorer.index.pending_prefill("a:1") == len(kept)
    assert scorer.index.prefilling_requests("a:1") == 1
    index = scorer.index  # its blocks go too; the kept prompt's stay
    assert index.num_speculative("a:1") == 2
    assert index.match(index.block_hashes(list(cancelled)))["a:1"] == 0
    assert index.match(index.block_hashes(list(kept)))["a:1"] == 2
    push(withdrawn_events(["cancelled"]))  # withdrawn twice: ended once
    assert scorer.index.pending_prefill("a:1") == len(kept)


def test_announced_prefills_are_remembered_within_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvswitch.epp.kvindex.events import QueuedPrompt as Announced
    from kvswitch.epp.plugins import precise_prefix_cache_scorer as plugin
    from kvswitch.protocol.packed import pack_token_ids

    monkeypatch.setattr(plugin, "MAX_ANNOUNCED", 3)
    now = [0.0]
    datalayer = Datalayer()
    datalayer.set_endpoints([EndpointSpec("a:1")])
    scorer = create("p", {"blockSize": 16, "tokenizer": "none", "prefillTtl": "10s"},
                    PluginHandle(datalayer))
    scorer.index.clock = lambda: now[0]
    scorer.feed_externally(["a:1"])

    def announce(request_id: str, first: int) -> None:
        scorer._queued("a:1", (Announced(request_id, (pack_token_ids(range(first, first + 16)),)),))

    for i in range(5):
        announce(f"r{i}", 100 * i)
    assert list(scorer._announced) == [("a:1", "r2"), ("a:1", "r3"), ("a:1", "r4")]
    assert scorer.index.pending_prefill("a:1") == 5 * 16  # (the index counts all five)
    now[0] = 10.0  # prefillTtl later: expired in the index (as a scrape sees it), forgotten here
    scorer.index.expire()
    assert scorer.index.pending_prefill("a:1") == 0
    announce("late", 900)
    assert list(scorer._announced) == [("a:1", "late")]


def test_an_sglang_engines_queued_prompt_reaches_the_callback_in_the_index_blocks() -> None:
    from kvswitch.epp.kvindex import KvBlockIndex
    from kvswitch.epp.kvindex.events import EventBatch, QueuedPrompt
    from kvswitch.epp.kvindex.hashing import chained_block_hashes, chained_packed_hashes
    from kvswitch.epp.kvindex.subscriber import KvEventSubscriber
    from kvswitch.protocol.packed import pack_token_ids

    index = KvBlockIndex(16)
    seen: list[tuple[tuple[QueuedPrompt, ...], tuple[str, ...]]] = []
    subscriber = KvEventSubscriber("b:1", index, on_queued=lambda a, q, w: seen.append((q, w)),
                                   api="sglang")
    ids = list(range(300, 370))  # 70 ids: the engine's two 32-token blocks, 6 left over
    engine_blocks = (pack_token_ids(ids[:32]), pack_token_ids(ids[32:64]))
    subscriber.handle(EventBatch(-1, load_only=True, queued=(QueuedPrompt("r1", engine_blocks),),
                                 withdrawn=("r0",)))
    ((prompt,), withdrawn), = seen
    assert withdrawn == ("r0",) and prompt.request_id == "r1"
    assert len(prompt.blocks) == 4  # cut into the index's 16-token blocks, as its own prompts
    assert chained_packed_hashes(prompt.blocks) == chained_block_hashes(ids, 16)[:4]
