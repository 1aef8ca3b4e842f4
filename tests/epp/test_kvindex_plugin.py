"""precise-prefix-cache-scorer: scores from the KV-event index, for token and text prompts."""

from __future__ import annotations

from kvswitch.epp.datalayer import Datalayer, Endpoint, EndpointSpec
from kvswitch.epp.framework import PluginHandle
from kvswitch.epp.kvindex import BlocksStored, StoredBlock
from kvswitch.epp.kvindex.precise_prefix_cache_scorer import TYPE, create
from kvswitch.epp.request import InferenceRequest, ParsedBody
from kvswitch.tokenization import load_tokenizer


def stored(tokens: list[int]) -> BlocksStored:
    return BlocksStored(tuple(StoredBlock(i, tuple(tokens[i * 16:(i + 1) * 16]))
                              for i in range(len(tokens) // 16)), None, 16)


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
