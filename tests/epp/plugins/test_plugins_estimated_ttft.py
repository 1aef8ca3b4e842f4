"""estimated-ttft-scorer: prefix affinity weighed against queued work, with exact inputs."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvswitch.epp.contracts import InferenceRequest, ParsedBody
from kvswitch.epp.datalayer import Datalayer, Endpoint, EndpointSpec, Metrics
from kvswitch.epp.framework import ConfigError, PluginHandle, SchedulerProfile
from kvswitch.epp.plugins.estimated_ttft_scorer import TYPE, RecentShares, create
from kvswitch.epp.plugins.max_score_picker import MaxScorePicker
from kvswitch.epp.plugins.prefix_index import STATE_KEY, PrefixMatch

PROMPT = 7200  # tokens: 450 blocks of 16
BLOCKS = PROMPT // 16


def endpoints(n: int = 4) -> list[Endpoint]:
    return [Endpoint(EndpointSpec(f"e{i}:1")) for i in range(n)]


def load(e: Endpoint, *, waiting: int = 0, waiting_tokens: int = 0, running: int = 0) -> None:
    e.metrics = Metrics(waiting=waiting, waiting_tokens=waiting_tokens, running=running)


def pick(eps: Sequence[Endpoint], matched: dict[str, int]) -> str:
    """One scheduling cycle with the scorer alone and the default picker."""
    scorer = create("t", {}, PluginHandle(Datalayer()))
    profile = SchedulerProfile("p", [], [(scorer, 1.0)], MaxScorePicker("m"))
    request = InferenceRequest("r", "grpc", "/g", ParsedBody(prompt_token_ids=(1,) * PROMPT))
    state = {STATE_KEY: PrefixMatch(tuple(range(BLOCKS)), matched)}
    return profile.run(request, state, eps).endpoints[0].address


def test_strong_prefix_match_wins_under_mild_load() -> None:
    assert TYPE == "estimated-ttft-scorer"
    eps = endpoints()
    load(eps[0], waiting=1, waiting_tokens=2000, running=8)  # mildly loaded, holds 6,000 tokens
    assert pick(eps, {"e0:1": 375}) == "e0:1"


def test_hot_group_spreads_once_its_replica_queue_grows() -> None:
    eps = endpoints()
    # The group's prefix (6,000 of 7,200 tokens) lives on e0; its queue grows with the group.
    picks = []
    for queued in range(12):
        load(eps[0], waiting=queued, waiting_tokens=queued * 1200, running=8)
        picks.append(pick(eps, {"e0:1": 375}))
    assert picks[0] == "e0:1"
    assert picks[-1] != "e0:1"  # 13,200 tokens queued > 6,000 saved: an empty replica wins
    first_spill = picks.index(next(p for p in picks if p != "e0:1"))
    assert all(p != "e0:1" for p in picks[first_spill:])  # and keeps winning as e0 grows


def sent(e: Endpoint, requests: int, uncached: int) -> None:
    """The EPP routed `requests` here, `uncached` prompt tokens each, that no report covers."""
    e.sent.clear()
    e.unreported_tokens = 0
    datalayer = Datalayer(clock=lambda: 0.0)
    for _ in range(requests):
        datalayer.record_sent(e, uncached)


def test_burst_before_a_load_update_spreads_by_unreported_prefill() -> None:
    eps = endpoints(2)
    sent(eps[0], 3, 1200)  # routed by the EPP, not yet in a load report
    assert pick(eps, {"e0:1": 375, "e1:1": 375}) == "e1:1"
    # A hot group's burst stays on its holder until the unseen work outweighs the saving:
    # each costs the holder 1,200 uncached tokens, an empty replica 7,200.
    sent(eps[0], 2, 1200)
    assert pick(eps, {"e0:1": 375}) == "e0:1"
    sent(eps[0], 6, 1200)
    assert pick(eps, {"e0:1": 375}) == "e1:1"


def test_new_groups_go_to_empty_replicas() -> None:
    eps = endpoints()
    load(eps[0], waiting=2, waiting_tokens=3000, running=20)
    load(eps[1], running=30)
    load(eps[2], waiting=1, waiting_tokens=500)
    # No replica holds the prompt: the one with the least work ahead wins.
    assert pick(eps, {}) == "e3:1"


def test_scores_are_ratios_of_work() -> None:
    eps = endpoints(2)
    load(eps[1], waiting=1, waiting_tokens=PROMPT)  # exactly one more prompt queued
    scorer = create("t", {"runningRequestTokens": 0}, PluginHandle(Datalayer()))
    request = InferenceRequest("r", "grpc", "/g", ParsedBody(prompt_token_ids=(1,) * PROMPT))
    scores = scorer.score(request, {STATE_KEY: PrefixMatch(tuple(range(BLOCKS)), {})}, eps)
    assert scores[0] == 1.0 and abs(scores[1] - (PROMPT + 1) / (2 * PROMPT + 1)) < 1e-12


def test_uncached_weight_keeps_a_group_on_its_holder_longer() -> None:
    eps = endpoints(2)
    load(eps[0], waiting=4, waiting_tokens=8000)  # holds 6,000 of the 7,200 tokens
    assert pick(eps, {"e0:1": 375}) == "e1:1"  # own TTFT: 8,000 + 1,200 > 7,200
    scorer = create("t", {"uncachedWeight": 2.0, "runningRequestTokens": 0},
                    PluginHandle(Datalayer()))
    profile = SchedulerProfile("p", [], [(scorer, 1.0)], MaxScorePicker("m"))
    request = InferenceRequest("r", "grpc", "/g", ParsedBody(prompt_token_ids=(1,) * PROMPT))
    state = {STATE_KEY: PrefixMatch(tuple(range(BLOCKS)), {"e0:1": 375})}
    # Counting the miss's prefill twice: 8,000 + 2,400 < 14,400.
    assert profile.run(request, state, eps).endpoints[0].address == "e0:1"


def test_a_sent_request_the_report_shows_running_counts_once() -> None:
    eps = endpoints(2)
    # e0: the EPP just sent it 4 requests (1,200 uncached tokens each) and a report sampled
    # within the proxy's hop already shows them running, without settling them.
    sent(eps[0], 4, 1200)
    load(eps[0], running=4)
    # e1: the same prefill queued, reported, and 2 requests of its own running.
    load(eps[1], waiting=4, waiting_tokens=4 * 1200, running=2)
    scorer = create("t", {"runningRequestTokens": 160}, PluginHandle(Datalayer()))
    request = InferenceRequest("r", "grpc", "/g", ParsedBody(prompt_token_ids=(1,) * PROMPT))
    state = {STATE_KEY: PrefixMatch(tuple(range(BLOCKS)), {})}
    scores = scorer.score(request, state, eps)
    assert scores[0] == 1.0 and scores[1] < 1.0  # 4,800 + 7,200 against 4,800 + 320 + 7,200
    # Not reported as running yet: the unreported account never takes the running term
    # below 0, and e1's 2 running requests still weigh.
    load(eps[0], running=0)
    assert scorer.score(request, state, eps) == scores


def test_a_request_charged_as_prefill_in_progress_is_not_charged_as_running_too() -> None:
    eps = endpoints(2)
    # e0: 4 requests (1,200 uncached tokens each) admitted and still prefilling: the report
    # shows them running, the KV events as prefill in progress. e1: the same work, waiting.
    load(eps[0], running=4)
    load(eps[1], waiting=4, waiting_tokens=4 * 1200)
    scorer = create("t", {"runningRequestTokens": 160}, PluginHandle(Datalayer()))
    request = InferenceRequest("r", "grpc", "/g", ParsedBody(prompt_token_ids=(1,) * PROMPT))
    state = {STATE_KEY: PrefixMatch(tuple(range(BLOCKS)), {}, pending_prefill={"e0:1": 4800},
                                    prefilling={"e0:1": 4})}
    assert scorer.score(request, state, eps) == [1.0, 1.0]
    # Two of e0's four are still waiting: only the two running are in both terms.
    load(eps[0], running=2, waiting=2, waiting_tokens=2 * 1200)
    assert scorer.score(request, state, eps) == [1.0, 1.0]
    # A longer reported queue than the prefill in progress: the running ones are not in it,
    # and count as running (2 x 160 more than e1).
    load(eps[0], running=2, waiting=4, waiting_tokens=4 * 1200 + 100)
    load(eps[1], waiting=4, waiting_tokens=4 * 1200 + 100 + 320)
    assert scorer.score(request, state, eps) == [1.0, 1.0]


def test_saturated_pool_keeps_a_group_on_its_holder_over_a_longer_queue() -> None:
    request = InferenceRequest("r", "grpc", "/g", ParsedBody(prompt_token_ids=(1,) * PROMPT))
    state = {STATE_KEY: PrefixMatch(tuple(range(BLOCKS)), {"e0:1": 62})}  # 992 tokens held

    def picked(saturation: float) -> str:
        scorer = create("t", {"uncachedWeight": 2.0, "runningRequestTokens": 0,
                              "saturationMissWeight": saturation}, PluginHandle(Datalayer()))
        profile = SchedulerProfile("p", [], [(scorer, 1.0)], MaxScorePicker("m"))
        return profile.run(request, state, eps).endpoints[0].address

    eps = endpoints(2)
    # Every replica has 30 requests waiting; the holder has 20,000 tokens more queued.
    load(eps[0], waiting=30, waiting_tokens=220_000)
    load(eps[1], waiting=30, waiting_tokens=200_000)
    assert picked(0.0) == "e1:1"  # 20,000 > 2 x 992 saved
    assert picked(1.0) == "e0:1"  # 20,000 < (2 + 30) x 992
    # One replica with nothing waiting: the pool does not queue, the charge is off.
    load(eps[1], waiting=0, waiting_tokens=0)
    load(eps[0], waiting=30, waiting_tokens=20_000)
    assert picked(1.0) == "e1:1"


def test_the_saturation_charge_takes_a_quantile_of_the_waiting_counts() -> None:
    request = InferenceRequest("r", "grpc", "/g", ParsedBody(prompt_token_ids=(1,) * PROMPT))
    state = {STATE_KEY: PrefixMatch(tuple(range(BLOCKS)), {"e0:1": BLOCKS})}  # held in full

    def picked(quantile: float) -> str:
        scorer = create("t", {"uncachedWeight": 2.0, "runningRequestTokens": 0,
                              "saturationMissWeight": 1.0, "saturationQuantile": quantile},
                        PluginHandle(Datalayer()))
        profile = SchedulerProfile("p", [], [(scorer, 1.0)], MaxScorePicker("m"))
        return profile.run(request, state, eps).endpoints[0].address

    eps = endpoints(8)
    # Seven replicas queue 10 requests each; one has just emptied its queue. The holder has
    # 60,000 tokens more queued than the empty one: over the 2 x PROMPT a miss costs without
    # the charge, under (2 + 10) x PROMPT with it.
    for e in eps[:7]:
        load(e, waiting=10, waiting_tokens=60_000)
    load(eps[7], waiting=0, waiting_tokens=0)
    assert picked(0.0) == "e7:1"  # the least waiting count: 0, no charge
    assert picked(0.75) == "e0:1"  # the 6th smallest of 8: 10
    # Only two of eight queue: under the quantile too, the pool does not queue.
    for e in eps[2:]:
        load(e, waiting=0, waiting_tokens=0)
    assert picked(0.75) != "e0:1"  # (one of the six empty ones)
    with pytest.raises(ConfigError, match="saturationQuantile: must be in"):
        create("t", {"saturationQuantile": 1.5}, PluginHandle(Datalayer()))


def test_a_short_prefix_is_copied_while_the_pool_has_room() -> None:
    request = InferenceRequest("r", "grpc", "/g", ParsedBody(prompt_token_ids=(1,) * PROMPT))

    def picked(matched: dict[str, int], threshold: float) -> str:
        scorer = create("t", {"uncachedWeight": 2.0, "runningRequestTokens": 160,
                              "saturationMissWeight": 1.0, "cacheThreshold": threshold},
                        PluginHandle(Datalayer()))
        profile = SchedulerProfile("p", [], [(scorer, 1.0)], MaxScorePicker("m"))
        state = {STATE_KEY: PrefixMatch(tuple(range(BLOCKS)), matched)}
        return profile.run(request, state, eps).endpoints[0].address

    eps = endpoints(3)
    for e in eps:
        load(e, running=4)
    system_prompt = {"e0:1": 62}  # 992 of 7,200 tokens, a system prompt before a question
    assert picked(system_prompt, 0.0) == "e0:1"  # followed: the holder saves 992 tokens
    assert picked(system_prompt, 0.5) != "e0:1"  # copied: a replica without it first
    # Held by every replica but one: the one left gets the copy.
    assert picked({"e0:1": 62, "e1:1": 62}, 0.5) == "e2:1"
    # Held everywhere: the charge is equal, and load alone decides.
    load(eps[1], running=3)
    assert picked({"e0:1": 62, "e1:1": 62, "e2:1": 62}, 0.5) == "e1:1"
    # A prefix over the threshold is followed (6,000 of 7,200 tokens).
    load(eps[1], running=4)
    assert picked({"e0:1": 375}, 0.5) == "e0:1"
    # A burst that has just sent every replica a prefill no report shows yet: no replica has
    # room for a copy, so the short prefix is followed.
    for e in eps:
        sent(e, 1, 7200)
    assert picked(system_prompt, 0.5) == "e0:1"
    for e in eps:
        sent(e, 0, 0)  # a report covers the burst
    # A saturated pool (every replica has requests waiting) follows a short prefix too.
    for e in eps:
        load(e, waiting=10, waiting_tokens=72_000, running=4)
    assert picked(system_prompt, 0.5) == "e0:1"


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_cache_threshold_is_a_fraction(bad: float) -> None:
    with pytest.raises(ConfigError, match="cacheThreshold: must be in"):
        create("t", {"cacheThreshold": bad}, PluginHandle(Datalayer()))


def test_beyond_two_holders_only_a_hot_prefix_is_copied() -> None:
    scorer = create("t", {"uncachedWeight": 2.0, "runningRequestTokens": 160,
                          "saturationMissWeight": 1.0, "cacheThreshold": 0.5,
                          "hotPrefixShare": 0.5, "hotPrefixWindow": 8},
                    PluginHandle(Datalayer()))
    profile = SchedulerProfile("p", [], [(scorer, 1.0)], MaxScorePicker("m"))
    request = InferenceRequest("r", "grpc", "/g", ParsedBody(prompt_token_ids=(1,) * PROMPT))
    eps = endpoints(3)
    for e in eps:
        load(e, running=4)

    def picked(prefix: int, holders: int) -> str:
        """Route a prompt whose 62-block short prefix `prefix` the first `holders` replicas hold."""
        hashes = tuple(range(prefix * BLOCKS, (prefix + 1) * BLOCKS))
        matched = {e.address: 62 for e in eps[:holders]}
        state = {STATE_KEY: PrefixMatch(hashes, matched)}
        return profile.run(request, state, eps).endpoints[0].address

    for other in range(1, 8):  # seven other prefixes, once each
        picked(other, 1)
    # A cold prefix (1 of the last 8 requests) on one replica: copied to a second.
    assert picked(0, 1) != "e0:1"
    # On two replicas at 2 of 8 requests, a holder would get 1/8 of all requests from it, not
    # over half of a replica's fair share (1/3 x 1/2): followed.
    assert picked(0, 2) in {"e0:1", "e1:1"}
    # Hot at 3 of 8 (3/8 x 3 replicas > 0.5 x 2 holders): copied to the third.
    assert picked(0, 2) == "e2:1"
    # Requests without a short prefix count toward the window: after 8 of them it is cold.
    long_match = {STATE_KEY: PrefixMatch(tuple(range(BLOCKS)), {"e0:1": 375})}
    for _ in range(8):
        profile.run(request, long_match, eps)
    assert picked(0, 2) in {"e0:1", "e1:1"}
    # Held by every replica: the match is equal everywhere, and load alone decides.
    load(eps[2], running=3)
    assert picked(0, 3) == "e2:1"
    # No prefix producer ran: load alone decides, and the request counts toward the window.
    load(eps[1], running=2)
    assert profile.run(request, {}, eps).endpoints[0].address == "e1:1"


def test_recent_shares_counts_a_sliding_window() -> None:
    shares = RecentShares(3)
    assert shares.add("a") == 1.0
    assert shares.add("b") == 0.5
    assert shares.add("a") == 2 / 3
    assert shares.add(None) == 0.0  # the window is b, a, None
    assert shares.add("b") == 1 / 3  # a, None, b: the first b has left
    assert shares.add("c") == 1 / 3
    assert shares.add("c") == 2 / 3  # b, c, c
    assert shares.add("d") == 1 / 3
    assert len(shares._counts) <= shares.window


@pytest.mark.parametrize(("key", "bad"), [("hotPrefixShare", -0.5), ("hotPrefixWindow", 0),
                                          ("hotPrefixWindow", 65_537)])
def test_hot_prefix_parameters_are_bounded(key: str, bad: float) -> None:
    with pytest.raises(ConfigError, match=f"{key}: must be"):
        create("t", {key: bad}, PluginHandle(Datalayer()))
