"""Speculative entries of the precise prefix index: match, confirm, expiry, removal (fake clock)."""

from __future__ import annotations

from kvswitch.epp.contracts import InferenceRequest, ParsedBody, RequestOutcome
from kvswitch.epp.datalayer import Datalayer, Endpoint, EndpointSpec
from kvswitch.epp.framework import ConfigError, PluginHandle, ProfileResult
from kvswitch.epp.kvindex import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    KvBlockIndex,
    StoredBlock,
)
from kvswitch.epp.plugins.precise_prefix_cache_scorer import create

B = 4
PROMPT = list(range(100, 120))  # 5 blocks of 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chain(tokens: list[int], start_hash: int = 1000) -> BlocksStored:
    blocks = tuple(StoredBlock.of(start_hash + i, tokens[i * B:(i + 1) * B])
                   for i in range(len(tokens) // B))
    return BlocksStored(blocks, None, B)


def new_index(*endpoints: str) -> tuple[KvBlockIndex, FakeClock]:
    clock = FakeClock()
    index = KvBlockIndex(B, clock=clock)
    for endpoint in endpoints:
        index.add_endpoint(endpoint)
    return index, clock


def test_speculative_blocks_match_until_they_expire() -> None:
    index, clock = new_index("a", "b")
    hashes = index.block_hashes(PROMPT)
    index.speculate("a", hashes, ttl=2.0)
    assert index.match(hashes) == {"a": 5, "b": 0}
    assert (index.num_speculative("a"), index.num_blocks("a")) == (5, 0)
    clock.now += 1.999
    assert index.match(hashes) == {"a": 5, "b": 0}
    clock.now += 0.001
    assert index.match(hashes) == {"a": 0, "b": 0}
    assert index.num_speculative("a") == 0


def test_unknown_endpoint_zero_ttl_and_empty_prompts_speculate_nothing() -> None:
    index, _ = new_index("a")
    hashes = index.block_hashes(PROMPT)
    index.speculate("not-subscribed", hashes, ttl=2.0)
    index.speculate("a", hashes, ttl=0.0)
    index.speculate("a", [], ttl=2.0)
    assert index.endpoints == ("a",)
    assert index.match(hashes) == {"a": 0}


def test_stored_events_confirm_speculative_blocks() -> None:
    index, clock = new_index("a")
    hashes = index.block_hashes(PROMPT)
    index.speculate("a", hashes, ttl=2.0)
    stats = index.apply("a", [chain(PROMPT[:12])])  # the engine stored the first 3 blocks
    assert (stats.stored, stats.confirmed) == (3, 3)
    assert (index.num_speculative("a"), index.num_blocks("a")) == (2, 3)
    assert [index.holds_really("a", h) for h in hashes] == [True] * 3 + [False] * 2
    assert not index.holds_really("unknown", hashes[0])
    clock.now += 5.0  # the unconfirmed tail expires, the confirmed head stays
    assert index.match(hashes) == {"a": 3}
    assert index.num_speculative("a") == 0
    # Confirmed blocks are real: a removal takes them out.
    assert index.apply("a", [BlocksRemoved((1001,))]).removed == 1
    assert index.match(hashes) == {"a": 1}


def test_speculating_real_blocks_adds_nothing_and_removal_still_wins() -> None:
    index, _ = new_index("a")
    index.apply("a", [chain(PROMPT[:8])])
    hashes = index.block_hashes(PROMPT)
    index.speculate("a", hashes, ttl=2.0)
    assert index.num_speculative("a") == 3  # only the 3 blocks not reported stored
    index.apply("a", [BlocksRemoved((1000,))])
    assert index.match(hashes) == {"a": 0}  # the first block left: no leading match


def test_speculating_again_extends_the_expiry() -> None:
    index, clock = new_index("a")
    hashes = index.block_hashes(PROMPT)
    index.speculate("a", hashes[:2], ttl=2.0)
    clock.now += 1.5
    index.speculate("a", hashes, ttl=2.0)
    clock.now += 1.0  # the first speculation's expiry passed; the second's did not
    assert index.match(hashes) == {"a": 5}
    clock.now += 1.0
    assert index.match(hashes) == {"a": 0}


def test_held_leading_blocks_keep_the_expiry_of_the_request_that_stores_them() -> None:
    index, clock = new_index("a")
    hashes = index.block_hashes(PROMPT)
    index.speculate("a", hashes[:3], ttl=2.0)
    clock.now += 1.5
    index.speculate("a", hashes, ttl=2.0, held=3)  # a second request: shared 3 + its own 2
    clock.now += 1.0
    assert index.match(hashes) == {"a": 0}  # the first request's prefix was never confirmed
    assert index.num_speculative("a") == 2
    clock.now += 1.0
    assert index.num_speculative("a") == 2  # lazily dropped...
    index.expire()
    assert index.num_speculative("a") == 0  # ...at the next query or expire()


def test_expiry_on_one_endpoint_keeps_the_other() -> None:
    index, clock = new_index("a", "b")
    hashes = index.block_hashes(PROMPT)
    index.apply("b", [chain(PROMPT)])
    index.speculate("a", hashes, ttl=1.0)
    assert index.match(hashes) == {"a": 5, "b": 5}
    clock.now += 1.0
    assert index.match(hashes) == {"a": 0, "b": 5}


def test_cleared_resync_and_removed_endpoint_drop_speculative_blocks() -> None:
    index, clock = new_index("a", "b")
    hashes = index.block_hashes(PROMPT)
    index.speculate("a", hashes, ttl=2.0)
    stats = index.apply("a", [CacheCleared(), chain(PROMPT[:4])])
    assert (stats.cleared, stats.confirmed) == (True, 0)  # dropped, not confirmed
    assert index.match(hashes) == {"a": 1, "b": 0}
    index.speculate("b", hashes, ttl=2.0)
    index.clear("b")  # a resync
    assert index.match(hashes) == {"a": 1, "b": 0}
    index.speculate("a", hashes, ttl=2.0)
    index.remove_endpoint("a")
    index.add_endpoint("c")  # takes a's bit; a's pending expiry must not touch it
    index.apply("c", [chain(PROMPT)])
    clock.now += 10.0
    assert index.match(hashes) == {"b": 0, "c": 5}


def test_withdraw_drops_a_speculation_at_once_but_not_a_later_claim() -> None:
    index, clock = new_index("a")
    hashes = index.block_hashes(PROMPT)
    first = index.speculate("a", hashes[:3], ttl=30.0)
    clock.now += 1.0
    second = index.speculate("a", hashes, ttl=30.0, held=2)  # claims blocks 2-4 again
    assert first is not None and second is not None
    index.withdraw(first)  # blocks 0-1 were first's alone; block 2 is second's now
    assert index.num_speculative("a") == 3
    assert index.match(hashes) == {"a": 0}  # the leading blocks left
    index.apply("a", [chain(PROMPT[:4])])  # block 0 stored: real, not speculative
    index.withdraw(second)  # drops 2-4; nothing real is touched
    assert index.num_speculative("a") == 0
    assert index.match(hashes) == {"a": 1}
    index.withdraw(None)
    assert index.speculate("a", hashes[:1], ttl=30.0) is None  # held really: nothing to hold


def test_speculated_blocks_are_bounded_oldest_first() -> None:
    clock = FakeClock()
    index = KvBlockIndex(B, clock=clock, max_speculated_blocks=8)
    index.add_endpoint("a")
    prompts = [index.block_hashes([p * 1000 + t for t in range(16)]) for p in range(3)]
    for hashes in prompts:  # 4 blocks each: the third pushes the first out
        index.speculate("a", hashes, ttl=30.0)
    assert [index.match(h)["a"] for h in prompts] == [0, 4, 4]
    assert index.num_speculative("a") == 8
    unbounded = KvBlockIndex(B, clock=clock, max_speculated_blocks=None)
    unbounded.add_endpoint("a")
    for hashes in prompts:
        unbounded.speculate("a", hashes, ttl=float("inf"))
    assert [unbounded.match(h)["a"] for h in prompts] == [4, 4, 4]


def test_scorer_withdraws_a_failed_request_and_keeps_a_queued_one() -> None:
    clock = FakeClock()
    scorer = create("p", {"blockSize": 16, "tokenizer": "none"}, PluginHandle(Datalayer()))
    scorer.index.clock = clock
    assert scorer.speculative_ttl == 30.0  # a prompt queued for seconds stays held
    endpoints = [Endpoint(EndpointSpec(a)) for a in ("a:1", "b:1")]
    for endpoint in endpoints:
        scorer.index.add_endpoint(endpoint.address)
    for request_id, ok in (("queued", True), ("failed", False)):
        ids = tuple(range(1000, 1064)) if ok else tuple(range(2000, 2064))
        request = InferenceRequest(request_id, "grpc", "/x", ParsedBody(prompt_token_ids=ids))
        state: dict[str, object] = {}
        scorer.produce(request, state, endpoints)
        scorer.pre_request(request, state, ProfileResult("default", (endpoints[0],)))
        clock.now += 20.0  # still queued, no BlockStored yet
        scorer.produce(request, state := {}, endpoints)
        assert scorer.score(request, state, endpoints) == [1.0, 0.0]
        if not ok:
            scorer.response_complete(request, RequestOutcome("a:1", ok=False, grpc_status=14))
            scorer.produce(request, state := {}, endpoints)
            assert scorer.score(request, state, endpoints) == [0.0, 0.0]


def test_scorer_speculates_on_the_picked_endpoint() -> None:
    datalayer = Datalayer()
    scorer = create("p", {"blockSize": 16, "tokenizer": "none", "speculativeTtl": "500ms"},
                    PluginHandle(datalayer))
    assert scorer.speculative_ttl == 0.5
    endpoints = [Endpoint(EndpointSpec(a)) for a in ("a:1", "b:1")]
    for endpoint in endpoints:
        scorer.index.add_endpoint(endpoint.address)
    ids = tuple(range(1000, 1064))  # 4 blocks of 16
    request = InferenceRequest("r1", "grpc", "/x", ParsedBody(prompt_token_ids=ids))
    state: dict[str, object] = {}
    scorer.produce(request, state, endpoints)
    assert scorer.score(request, state, endpoints) == [0.0, 0.0]
    scorer.pre_request(request, state, ProfileResult("default", (endpoints[1],)))
    again = InferenceRequest("r2", "grpc", "/x", ParsedBody(prompt_token_ids=ids + (7,) * 16))
    state = {}
    scorer.produce(again, state, endpoints)
    assert scorer.score(again, state, endpoints) == [0.0, 0.8]


def test_speculative_ttl_zero_disables_and_negative_is_rejected() -> None:
    handle = PluginHandle(Datalayer())
    scorer = create("p", {"blockSize": 16, "tokenizer": "none", "speculativeTtl": 0}, handle)
    scorer.index.add_endpoint("a:1")
    ids = tuple(range(1000, 1064))
    request = InferenceRequest("r1", "grpc", "/x", ParsedBody(prompt_token_ids=ids))
    state: dict[str, object] = {}
    endpoints = [Endpoint(EndpointSpec("a:1"))]
    scorer.produce(request, state, endpoints)
    scorer.pre_request(request, state, ProfileResult("default", tuple(endpoints)))
    assert scorer.index.num_speculative("a:1") == 0
    try:
        create("q", {"blockSize": 16, "tokenizer": "none", "speculativeTtl": -1}, handle)
    except ConfigError as exc:
        assert "speculativeTtl" in str(exc)
    else:
        raise AssertionError("a negative speculativeTtl was accepted")


def test_default_profile_keeps_a_prefix_together_before_any_kv_event() -> None:
    from kvswitch.epp.config import build_endpoint_picker, static_pool
    from kvswitch.epp.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
    from kvswitch.epp.router import EppRouter
    from kvswitch.launcher import DEFAULT_EPP_CONFIG

    addresses = [f"127.0.0.1:{9001 + i}" for i in range(4)]
    router = build_endpoint_picker(DEFAULT_EPP_CONFIG, static_pool(addresses)).router
    assert isinstance(router, EppRouter)
    scorer = next(p for p in router.scheduler.plugins if isinstance(p, PrecisePrefixCacheScorer))
    for address in addresses:
        scorer.index.add_endpoint(address)  # what the (absent) subscriptions would do
    endpoints = [Endpoint(EndpointSpec(a)) for a in addresses]
    for group in range(20):
        shared = tuple(range(group * 1000, group * 1000 + 64))
        picks = [router.scheduler.schedule(
            InferenceRequest(f"g{group}-{i}", "grpc", "/x",
                             ParsedBody(prompt_token_ids=shared + (i,) * 16)),
            endpoints).endpoints[0].address for i in range(3)]
        assert len(set(picks)) == 1, (group, picks)


def test_random_speculation_and_events_agree_with_a_plain_model() -> None:
    """Speculations (some with a held leading run), stores of whole or partial prompts (which
    confirm), removals, clears and a clock moving past expiries over 3 endpoints sharing
    prefixes: every match equals a plain model (held = real, or speculative and unexpired)."""
    import random

    from kvswitch.epp.kvindex import chained_block_hashes

    rnd = random.Random(11)
    prompts = [[rnd.randrange(40) for _ in range(B * 6)] for _ in range(3)]
    prompts += [p[:B * 2] + [rnd.randrange(40) for _ in range(B * 4)] for p in prompts]
    owns = [chained_block_hashes(p, B) for p in prompts]
    engines = [[hash(("engine", i, k)) for k in range(6)] for i in range(len(prompts))]
    index, clock = new_index("a", "b", "c")
    real: dict[str, dict[int, int]] = {e: {} for e in "abc"}  # engine hash -> own hash
    copies: dict[str, dict[int, int]] = {e: {} for e in "abc"}  # engine hash -> copies
    spec: dict[str, dict[int, float]] = {e: {} for e in "abc"}  # own hash -> expiry
    for _ in range(3000):
        endpoint, p = rnd.choice("abc"), rnd.randrange(len(prompts))
        roll = rnd.random()
        if roll < 0.35:
            held = index.match(owns[p], [endpoint])[endpoint] if rnd.random() < 0.5 else 0
            ttl = rnd.choice([0.5, 1.0, 3.0])
            index.speculate(endpoint, owns[p], ttl, held=held)
            for own in owns[p][held:]:
                if own not in real[endpoint].values():
                    spec[endpoint][own] = clock.now + ttl
        elif roll < 0.6:
            end = rnd.randrange(1, 7)  # from the root: always placed
            index.apply(endpoint, [BlocksStored(tuple(
                StoredBlock.of(engines[p][k], prompts[p][k * B:(k + 1) * B])
                for k in range(end)), None, B)])
            for k in range(end):
                h = engines[p][k]
                real[endpoint][h] = owns[p][k]
                copies[endpoint][h] = copies[endpoint].get(h, 0) + 1
                spec[endpoint].pop(owns[p][k], None)
        elif roll < 0.8:
            gone = rnd.sample(engines[p], 2)
            index.apply(endpoint, [BlocksRemoved(tuple(gone))])
            for h in gone:
                if h in copies[endpoint]:
                    copies[endpoint][h] -= 1
                    if not copies[endpoint][h]:
                        del copies[endpoint][h], real[endpoint][h]
        elif roll < 0.83:
            index.apply(endpoint, [CacheCleared()])
            real[endpoint].clear()
            copies[endpoint].clear()
            spec[endpoint].clear()
        else:
            clock.now += rnd.choice([0.1, 0.4, 1.0])
        held_by = {e: set(real[e].values()) | {o for o, t in spec[e].items() if t > clock.now}
                   for e in "abc"}
        for hashes in owns:
            expected = {e: next((i for i, h in enumerate(hashes) if h not in held_by[e]),
                                len(hashes)) for e in "abc"}
            assert index.match(hashes, "abc") == expected
            assert index.match_held(hashes, "abc") == {e: n for e, n in expected.items() if n}
