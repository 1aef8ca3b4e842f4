"""Scorers and the prefix index: exact scores for exact inputs."""

from __future__ import annotations

from kvswitch.epp.contracts import InferenceRequest, ParsedBody
from kvswitch.epp.datalayer import Datalayer, Endpoint, EndpointSpec, Metrics
from kvswitch.epp.framework import PluginHandle, ProfileResult
from kvswitch.epp.plugins import (
    kv_cache_utilization_scorer,
    prefix_cache_scorer,
    queue_scorer,
    running_requests_size_scorer,
    session_affinity_scorer,
)
from kvswitch.epp.plugins.prefix_index import STATE_KEY, RoutedPrefixIndex, request_block_hashes


def ep(i: int, **metrics: float) -> Endpoint:
    e = Endpoint(EndpointSpec(f"10.0.0.{i}:8000"))
    e.metrics = Metrics(**metrics)  # type: ignore[arg-type]
    return e


def req(tokens: tuple[int, ...] | None = None, text: str | None = None,
        headers: dict[str, str] | None = None, model: str | None = None) -> InferenceRequest:
    return InferenceRequest("r", "grpc", "/p",
                            ParsedBody(model=model, prompt_token_ids=tokens, prompt_text=text),
                            headers=headers or {})


HANDLE = PluginHandle(Datalayer())


def test_queue_scorer_is_min_max_inverse() -> None:
    scorer = queue_scorer.create("q", {}, HANDLE)
    eps = [ep(0, waiting=0), ep(1, waiting=5), ep(2, waiting=10)]
    assert scorer.score(req(), {}, eps) == [1.0, 0.5, 0.0]
    assert scorer.score(req(), {}, [ep(0, waiting=3), ep(1, waiting=3)]) == [1.0, 1.0]


def test_kv_cache_utilization_scorer() -> None:
    scorer = kv_cache_utilization_scorer.create("kv", {}, HANDLE)
    assert scorer.score(req(), {}, [ep(0, kv_usage=0.25), ep(1, kv_usage=1.0)]) == [0.75, 0.0]


def test_running_requests_scorer_counts_the_epps_own_in_flight() -> None:
    scorer = running_requests_size_scorer.create("rr", {}, HANDLE)
    a, b = ep(0, running=2), ep(1, running=2)
    b.in_flight = 6
    assert scorer.score(req(), {}, [a, b]) == [1.0, 0.0]


def test_block_hashes_chain_full_blocks_only() -> None:
    r = req(tokens=tuple(range(40)))
    hashes = request_block_hashes(r, 16, 4, 256)
    assert len(hashes) == 2  # 40 tokens -> 2 full blocks of 16
    # Same first block, different second block -> first hash equal, second differs.
    other = request_block_hashes(req(tokens=tuple(range(16)) + (99,) * 16), 16, 4, 256)
    assert other[0] == hashes[0] and other[1] != hashes[1]
    # A different first block changes every later hash (the chain).
    shifted = request_block_hashes(req(tokens=(7,) + tuple(range(1, 40))), 16, 4, 256)
    assert shifted[1] != hashes[1]
    # The model seeds the chain.
    assert request_block_hashes(req(tokens=tuple(range(40)), model="m"), 16, 4, 256)[0] != hashes[0]
    assert len(request_block_hashes(req(tokens=tuple(range(4000))), 16, 4, 8)) == 8


def test_text_prompts_hash_blocks_of_block_size_times_chars_per_token() -> None:
    assert len(request_block_hashes(req(text="x" * 130), 16, 4, 256)) == 2  # 64-character blocks


def test_prefix_index_matches_leading_blocks_per_endpoint() -> None:
    index = RoutedPrefixIndex(block_size=4)
    index.record("a", [1, 2, 3, 4], capacity=100)
    index.record("b", [1, 2], capacity=100)
    index.record("c", [9], capacity=100)
    assert index.match([1, 2, 3, 5]) == {"a": 3, "b": 2}
    assert index.match([1, 2, 3, 4, 6, 7, 8]) == {"a": 4, "b": 2}
    assert index.match([9, 2]) == {"c": 1}
    assert index.match([7, 1]) == {}


def test_prefix_index_lru_evicts_oldest_blocks_and_forgets_endpoints() -> None:
    index = RoutedPrefixIndex()
    index.record("a", [1, 2, 3], capacity=3)  # tail first: 3 is the oldest, 1 the newest
    index.record("a", [5], capacity=3)  # evicts 3, the tail
    assert index.size("a") == 3
    assert index.match([1, 2, 3]) == {"a": 2}
    index.record("a", [1], capacity=3)  # touch 1: now 2 is the oldest
    index.record("a", [4], capacity=3)
    assert index.match([1, 2]) == {"a": 1} and index.match([5]) == {"a": 1}
    index.forget("a")
    assert index.match([1]) == {}


def test_prefix_scorer_normalises_matched_over_total_blocks() -> None:
    handle = PluginHandle(Datalayer())
    scorer = prefix_cache_scorer.create("p", {"blockSize": 4}, handle)
    index = scorer.index
    a, b = ep(0), ep(1)
    r = req(tokens=tuple(range(16)))  # 4 blocks
    state: dict[str, object] = {}
    index.produce(r, state, [a, b])
    assert scorer.score(r, state, [a, b]) == [0.0, 0.0]
    index.pre_request(r, state, ProfileResult("p", (a,)))
    partial = req(tokens=tuple(range(8)) + (50,) * 8)  # first 2 of 4 blocks match a
    state = {}
    index.produce(partial, state, [a, b])
    assert state[STATE_KEY].matched == {a.address: 2}
    assert scorer.score(partial, state, [a, b]) == [0.5, 0.0]


def test_prefix_index_capacity_comes_from_the_engines_kv_size() -> None:
    handle = PluginHandle(Datalayer())
    scorer = prefix_cache_scorer.create("p", {"blockSize": 4, "lruCapacityPerServer": 1000},
                                        handle)
    small = ep(0, max_tokens=8)  # 2 blocks of 4
    r = req(tokens=tuple(range(16)))
    state: dict[str, object] = {}
    scorer.index.produce(r, state, [small])
    scorer.index.pre_request(r, state, ProfileResult("p", (small,)))
    assert scorer.index.size(small.address) == 2


def test_two_prefix_scorers_share_one_index() -> None:
    handle = PluginHandle(Datalayer())
    a = prefix_cache_scorer.create("a", {}, handle)
    b = prefix_cache_scorer.create("b", {}, handle)
    assert a.index is b.index and handle.shared_objects() == [a.index]


def test_session_affinity_prefers_the_sessions_endpoint() -> None:
    scorer = session_affinity_scorer.create("s", {}, HANDLE)
    a, b = ep(0), ep(1)
    assert scorer.score(req(headers={"x-session-token": "10.0.0.1:8000"}), {}, [a, b]) == [0, 1]
    r = req(headers={"x-session-token": "alice"})
    assert scorer.score(r, {}, [a, b]) == [0.0, 0.0]
    scorer.pre_request(r, {}, ProfileResult("p", (a,)))
    assert scorer.score(r, {}, [a, b]) == [1.0, 0.0]
