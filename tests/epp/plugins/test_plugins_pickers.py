"""Pickers, the profile handler and the low-queue filter."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvswitch.epp.contracts import InferenceRequest, ParsedBody
from kvswitch.epp.datalayer import Datalayer, Endpoint, EndpointSpec, Metrics
from kvswitch.epp.framework import PluginHandle
from kvswitch.epp.plugins import low_queue_filter, max_score_picker, round_robin_picker
from kvswitch.epp.plugins.max_score_picker import MaxScorePicker
from kvswitch.epp.plugins.prefix_index import STATE_KEY, PrefixMatch
from kvswitch.epp.plugins.random_picker import RandomPicker
from kvswitch.epp.plugins.weighted_random_picker import WeightedRandomPicker

REQ = InferenceRequest("r", "grpc", "/p", ParsedBody())
HANDLE = PluginHandle(Datalayer())
EPS = [Endpoint(EndpointSpec(f"10.0.0.{i}:8000")) for i in range(4)]


def names(eps: tuple[Endpoint, ...]) -> list[str]:
    return [e.address.split(".")[-1] for e in eps]


def test_max_score_picks_the_best_and_returns_fallbacks_in_score_order() -> None:
    picker = max_score_picker.create("m", {"maxNumOfEndpoints": 3}, HANDLE)
    assert names(picker.pick(REQ, {}, EPS, [0.1, 0.9, 0.5, 0.7])) == [
        "1:8000", "3:8000", "2:8000"]
    # Fewer endpoints than maxNumOfEndpoints: all of them, best first.
    assert names(picker.pick(REQ, {}, EPS[:2], [0.2, 0.6])) == ["1:8000", "0:8000"]
    single = max_score_picker.create("m", {}, HANDLE)
    assert single.pick(REQ, {}, EPS, [0.1, 0.9, 0.5, 0.7]) == (EPS[1],)
    assert single.pick(REQ, {}, [], []) == ()


def test_max_score_breaks_ties_at_random() -> None:
    picker = MaxScorePicker("m", rng=random.Random(1))
    seen = Counter(picker.pick(REQ, {}, EPS, [1.0, 1.0, 0.0, 1.0])[0].address
                   for _ in range(300))
    assert set(seen) == {EPS[0].address, EPS[1].address, EPS[3].address}
    assert min(seen.values()) > 60


def test_max_score_with_fallbacks_breaks_ties_at_random() -> None:
    picker = MaxScorePicker("m", 2, rng=random.Random(5))
    firsts: Counter[str] = Counter()
    for _ in range(300):
        pick = picker.pick(REQ, {}, EPS, [0.5, 0.9, 0.9, 0.1])
        assert set(pick) == {EPS[1], EPS[2]}
        firsts[pick[0].address] += 1
    assert min(firsts.values()) > 100
    # A tie at the cut: either 0.5 may be the fallback.
    fallbacks = Counter(picker.pick(REQ, {}, EPS, [0.5, 0.9, 0.5, 0.1])[1].address
                        for _ in range(300))
    assert set(fallbacks) == {EPS[0].address, EPS[2].address}
    assert min(fallbacks.values()) > 100
    # No tie: the order is the scores' order.
    assert picker.pick(REQ, {}, EPS, [0.5, 0.9, 0.5, 0.7]) == (EPS[1], EPS[3])


def test_max_score_gives_a_tie_to_the_longest_prefix_then_the_fewest_in_flight() -> None:
    eps = [Endpoint(EndpointSpec(f"10.0.1.{i}:8000")) for i in range(4)]
    eps[1].in_flight = 5
    eps[3].in_flight = 1
    # Tied on 1.0: 1 and 3 hold 8 leading blocks, 0 holds 2; 2 is not tied.
    state = {STATE_KEY: PrefixMatch(tuple(range(10)), {eps[0].address: 2, eps[1].address: 8,
                                                       eps[2].address: 9, eps[3].address: 8})}
    scores = [1.0, 1.0, 0.5, 1.0]
    for n in (1, 2):
        picker = MaxScorePicker("m", n, rng=random.Random(7))
        # Between the two holders of 8 blocks, the one with fewer in flight.
        assert {picker.pick(REQ, state, eps, scores)[0] for _ in range(50)} == {eps[3]}
    eps[3].in_flight = 9
    assert MaxScorePicker("m").pick(REQ, state, eps, scores) == (eps[1],)
    # The most blocks wins even against fewer in flight.
    eps[0].in_flight = 0
    state[STATE_KEY].matched[eps[1].address] = 1
    assert MaxScorePicker("m").pick(REQ, state, eps, scores) == (eps[3],)
    # Within tieTolerance too.
    picker = MaxScorePicker("m", tie_tolerance=0.05)
    assert picker.pick(REQ, state, eps, [0.97, 1.0, 0.5, 0.96]) == (eps[3],)
    # No tied endpoint holds any block: fewest in flight.
    state[STATE_KEY] = PrefixMatch(tuple(range(10)), {eps[2].address: 9})
    assert MaxScorePicker("m").pick(REQ, state, eps, scores) == (eps[0],)


def test_new_prefixes_of_one_length_spread_over_the_near_best_endpoints_evenly() -> None:
    picker = max_score_picker.create("m", {"maxNumOfEndpoints": 2, "newPrefixTolerance": 0.05},
                                     HANDLE)
    new = {STATE_KEY: PrefixMatch(tuple(range(10)), {})}  # no endpoint holds a block of it
    # 0, 1 and 3 are within 0.05 of the best; 2 is not, however few new prefixes it took.
    scores = [0.97, 1.0, 0.5, 0.96]
    firsts = [picker.pick(REQ, new, EPS, scores)[0] for _ in range(9)]
    assert Counter(firsts) == {EPS[0]: 3, EPS[1]: 3, EPS[3]: 3}
    assert firsts[0] == EPS[1]  # even counts: the highest total first
    assert picker.pick(REQ, new, EPS, scores) == (EPS[1], EPS[0])  # fallbacks: score order
    # A prompt some endpoint holds blocks of is not new: the best total, as without it.
    held = {STATE_KEY: PrefixMatch(tuple(range(10)), {EPS[3].address: 2})}
    assert all(picker.pick(REQ, held, EPS, scores)[0] == EPS[1] for _ in range(4))
    # Off by default: a new prefix takes the best total too.
    assert max_score_picker.create("m", {}, HANDLE).pick(REQ, new, EPS, scores) == (EPS[1],)


def test_a_new_prefix_goes_by_the_scores_alone_while_every_endpoint_queues() -> None:
    eps = [Endpoint(EndpointSpec(f"10.0.2.{i}:8000")) for i in range(3)]
    picker = MaxScorePicker("m", new_prefix_tolerance=0.05)
    new = {STATE_KEY: PrefixMatch(tuple(range(10)), {})}
    scores = [1.0, 0.98, 0.97]
    assert [picker.pick(REQ, new, eps, scores)[0] for _ in range(3)] == [eps[0], eps[1], eps[2]]
    for e in eps:
        e.metrics = Metrics(waiting=2)
    assert all(picker.pick(REQ, new, eps, scores) == (eps[0],) for _ in range(3))
    eps[2].metrics = Metrics(waiting=0)  # room again: spread, the queued picks uncounted
    assert [picker.pick(REQ, new, eps, scores)[0] for _ in range(2)] == [eps[0], eps[1]]


def test_the_new_prefix_counts_cover_a_bounded_window() -> None:
    picker = MaxScorePicker("m", new_prefix_tolerance=0.1, rng=random.Random(3))
    new = {STATE_KEY: PrefixMatch(tuple(range(10)), {})}
    for _ in range(max_score_picker.NEW_PREFIX_WINDOW):
        picker.pick(REQ, new, EPS[:1], [1.0])  # the only endpoint then
    # EPS[0] holds the whole window: the others take the next ones until it slides.
    firsts = Counter(picker.pick(REQ, new, EPS, [1.0] * 4)[0] for _ in range(30))
    assert EPS[0] not in firsts and sum(firsts.values()) == 30
    assert sum(picker._new_prefix_counts.values()) == 10 * max_score_picker.NEW_PREFIX_WINDOW


def test_new_prefixes_balance_by_their_blocks() -> None:
    picker = MaxScorePicker("m", new_prefix_tolerance=0.05)
    long, short = PrefixMatch(tuple(range(40)), {}), PrefixMatch(tuple(range(10)), {})
    assert picker.pick(REQ, {STATE_KEY: long}, EPS[:2], [1.0, 0.99])[0] == EPS[0]
    # 40 blocks went to EPS[0]: the next four 10-block prompts go to EPS[1], then it is even.
    firsts = [picker.pick(REQ, {STATE_KEY: short}, EPS[:2], [1.0, 0.99])[0] for _ in range(4)]
    assert firsts == [EPS[1]] * 4
    assert picker._new_prefix_counts == {EPS[0].address: 40, EPS[1].address: 40}


def test_new_prefix_tolerance_must_not_be_negative() -> None:
    from kvswitch.epp.framework import ConfigError

    with pytest.raises(ConfigError, match="newPrefixTolerance: must be >= 0"):
        max_score_picker.create("m", {"newPrefixTolerance": -0.1}, HANDLE)


def test_weighted_random_follows_scores() -> None:
    picker = WeightedRandomPicker("w", rng=random.Random(2))
    seen = Counter(picker.pick(REQ, {}, EPS, [0.0, 3.0, 1.0, 0.0])[0].address
                   for _ in range(2000))
    assert set(seen) == {EPS[1].address, EPS[2].address}
    assert 0.68 < seen[EPS[1].address] / 2000 < 0.82  # expect 0.75
    fallbacks = WeightedRandomPicker("w", 4, random.Random(3)).pick(REQ, {}, EPS,
                                                                     [0.0, 3.0, 1.0, 0.0])
    assert set(fallbacks[:2]) == {EPS[1], EPS[2]} and len(fallbacks) == 4


def test_random_picker_covers_everyone() -> None:
    picker = RandomPicker("r", rng=random.Random(4))
    assert {picker.pick(REQ, {}, EPS, [0.0] * 4)[0] for _ in range(100)} == set(EPS)


def test_round_robin_cycles_in_address_order() -> None:
    picker = round_robin_picker.create("rr", {"maxNumOfEndpoints": 2}, HANDLE)
    shuffled = [EPS[2], EPS[0], EPS[3], EPS[1]]
    picks = [names(picker.pick(REQ, {}, shuffled, [0.0] * 4)) for _ in range(5)]
    assert picks == [["0:8000", "1:8000"], ["1:8000", "2:8000"], ["2:8000", "3:8000"],
                     ["3:8000", "0:8000"], ["0:8000", "1:8000"]]


def test_low_queue_filter_keeps_short_queues_or_everyone() -> None:
    f = low_queue_filter.create("f", {"threshold": 3}, HANDLE)
    a, b = Endpoint(EndpointSpec("a:1")), Endpoint(EndpointSpec("b:1"))
    a.metrics, b.metrics = Metrics(waiting=1), Metrics(waiting=9)
    assert list(f.filter(REQ, {}, [a, b])) == [a]
    a.metrics = Metrics(waiting=10)
    assert list(f.filter(REQ, {}, [a, b])) == [a, b]


@pytest.mark.parametrize("type_name", ["max-score-picker", "random-picker",
                                       "weighted-random-picker", "round-robin-picker"])
def test_pickers_reject_fewer_than_one_endpoint(type_name: str) -> None:
    from kvswitch.epp.framework import ConfigError, load_factory

    factory = load_factory(type_name)
    with pytest.raises(ConfigError, match="maxNumOfEndpoints: must be >= 1"):
        factory("p", {"maxNumOfEndpoints": 0}, None)  # type: ignore[arg-type]
    assert (factory("p", {"maxNumOfEndpoints": 3}, None)  # type: ignore[arg-type, attr-defined]
            .max_endpoints == 3)
