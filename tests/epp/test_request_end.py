"""A request that ended stops counting as load on its endpoint (the real router and plugins).

Until a load report covers it, a routed request is in its endpoint's unreported account, and
until the engine stores its prompt's last block it is prefill in progress. Its response can
come before either (KV-event batches and their load records are coalesced over 50 ms): from
its end on, it is neither.
"""

from __future__ import annotations

import copy
from typing import Any

from kvswitch.epp.access_log import LoggedEnd
from kvswitch.epp.config import build_endpoint_picker, static_pool
from kvswitch.epp.contracts import InferenceRequest, ParsedBody, RequestOutcome
from kvswitch.epp.datalayer import Datalayer, Endpoint, EndpointSpec, Metrics
from kvswitch.epp.kvindex import KvBlockIndex
from kvswitch.epp.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvswitch.epp.router import EppRouter
from kvswitch.launcher import DEFAULT_EPP_CONFIG
from tests.support.kvblocks import stored

REPLICAS = 4
SHARED = list(range(100_000, 100_064))  # 4 blocks of 16: a short shared prefix
TAIL = 512


def prompt(n: int) -> tuple[int, ...]:
    return (*SHARED, *range(n * TAIL, (n + 1) * TAIL))


def following_config() -> dict[str, Any]:
    """The default profile with its copy of short prefixes off (cacheThreshold 0): these tests
    read the load terms' accounting through a short prefix's holder keeping its requests."""
    config: dict[str, Any] = copy.deepcopy(DEFAULT_EPP_CONFIG)
    for plugin in config["plugins"]:
        if plugin["type"] == "estimated-ttft-scorer":
            plugin["parameters"]["cacheThreshold"] = 0.0
    return config


def default_router() -> tuple[EppRouter, PrecisePrefixCacheScorer, list[str]]:
    """The default profile (following short prefixes) over idle replicas, the first holding
    the shared prefix."""
    addresses = [f"127.0.0.1:{20000 + i}" for i in range(REPLICAS)]  # nothing is contacted
    router = build_endpoint_picker(following_config(), static_pool(addresses)).router
    assert isinstance(router, EppRouter)
    datalayer = router.datalayer
    datalayer.set_endpoints(router.refresher.discovery.endpoints)  # type: ignore[union-attr]
    datalayer.staleness = 1e9
    for address in addresses:
        datalayer.update(address, Metrics(max_tokens=500_000, block_size=16,
                                          updated_at=datalayer.clock()))
    scorer = next(p for p in router.scheduler.plugins if isinstance(p, PrecisePrefixCacheScorer))
    scorer._handle = None  # no KV-event subscriptions: the test feeds the index itself
    scorer.index.apply(addresses[0], [stored(SHARED)])
    return router, scorer, addresses


def request(n: int, *, logged: bool = False) -> InferenceRequest:
    return InferenceRequest(f"r{n}", "grpc", "/x", ParsedBody(prompt_token_ids=prompt(n)),
                            access_logged=logged)


def endpoint(router: EppRouter, address: str) -> Endpoint:
    found = router.datalayer.get(address)
    assert found is not None
    return found


async def test_an_ended_request_leaves_the_unreported_account_and_the_prefill_in_progress(
        ) -> None:
    router, scorer, addresses = default_router()
    holder = endpoint(router, addresses[0])
    first = request(1)
    assert (await router.route(first, None)).endpoints[0] == addresses[0]
    assert (holder.unreported_requests, holder.unreported_tokens) == (1, TAIL)
    assert scorer.index.pending_prefill(addresses[0]) == TAIL
    assert scorer.index.prefilling_requests(addresses[0]) == 1
    # It ends before any load report or KV-event batch of the holder reaches the EPP.
    router.request_finished(first, RequestOutcome(endpoint=addresses[0], ok=True))
    assert (holder.unreported_requests, holder.unreported_tokens, holder.in_flight) == (0, 0, 0)
    assert scorer.index.pending_prefill(addresses[0]) == 0
    assert scorer.index.prefilling_requests(addresses[0]) == 0


async def test_a_request_ended_by_its_access_log_entry_leaves_them_too() -> None:
    router, scorer, addresses = default_router()
    holder = endpoint(router, addresses[0])
    first = request(1, logged=True)
    await router.route(first, None)
    # Its ext_proc stream closed before the response ended: it counts until the log says so.
    router.request_finished(first, RequestOutcome(endpoint="", ok=False, seen_end=False))
    assert holder.unreported_tokens == TAIL and scorer.index.pending_prefill(addresses[0]) == TAIL
    router.request_logged(LoggedEnd("r1", grpc_status=0, http_status=200, usage={},
                                    duration=0.1))
    assert (holder.unreported_requests, holder.unreported_tokens, holder.in_flight) == (0, 0, 0)
    assert scorer.index.pending_prefill(addresses[0]) == 0


async def test_back_to_back_requests_of_a_short_prefix_stay_on_its_holder() -> None:
    # The 64 shared tokens save less than the first request's 512 uncached ones cost while
    # they still count as load: only its end lets the next request follow the prefix.
    router, _, addresses = default_router()
    for n in range(1, 6):
        next_request = request(n)
        assert (await router.route(next_request, None)).endpoints[0] == addresses[0], n
        router.request_finished(next_request, RequestOutcome(endpoint=addresses[0], ok=True))


async def test_a_report_before_the_end_leaves_nothing_to_release() -> None:
    router, scorer, addresses = default_router()
    holder = endpoint(router, addresses[0])
    first, second = request(1), request(2)
    await router.route(first, None)
    scorer.index.apply(addresses[0], [stored(list(prompt(1)))])  # its prefill has ended
    clock = router.datalayer.clock
    router.datalayer.clock = lambda: clock() + 1.0  # a report sampled well after the send
    router.datalayer.update(addresses[0], Metrics(max_tokens=500_000, block_size=16,
                                                  updated_at=router.datalayer.clock()))
    assert holder.unreported_requests == 0
    assert (await router.route(second, None)).endpoints[0] == addresses[0]
    router.request_finished(first, RequestOutcome(endpoint=addresses[0], ok=True))
    # The second request's record is not the first's to drop.
    assert (holder.unreported_requests, holder.unreported_tokens) == (1, TAIL)


async def test_an_end_after_a_report_counted_it_running_is_off_the_running_count() -> None:
    # The holder's last report (sampled after the send) shows the request running; the engine,
    # idle after it, sends no other before its heartbeat. The next request still stays.
    router, scorer, addresses = default_router()
    holder = endpoint(router, addresses[0])
    datalayer = router.datalayer
    clock = datalayer.clock
    first = request(1)
    await router.route(first, None)
    scorer.index.apply(addresses[0], [stored(list(prompt(1)))])
    datalayer.clock = lambda: clock() + 1.0
    datalayer.update(addresses[0], Metrics(running=1, max_tokens=500_000, block_size=16,
                                           updated_at=datalayer.clock()))
    assert holder.unreported_requests == 0
    datalayer.clock = lambda: clock() + 2.0
    router.request_finished(first, RequestOutcome(endpoint=addresses[0], ok=True))
    assert holder.unreported_ends == 1
    second = request(2)
    assert (await router.route(second, None)).endpoints[0] == addresses[0]
    datalayer.clock = lambda: clock() + 3.0  # a report sampled after the end: it shows it gone
    datalayer.update(addresses[0], Metrics(running=1, max_tokens=500_000, block_size=16,
                                           updated_at=datalayer.clock()))
    assert holder.unreported_ends == 0


def one_endpoint(now: list[float]) -> tuple[Datalayer, Endpoint]:
    """A data layer on the clock `now[0]` with one endpoint, `e:1`."""
    datalayer = Datalayer(clock=lambda: now[0])
    datalayer.set_endpoints([EndpointSpec("e:1")])
    e = datalayer.get("e:1")
    assert e is not None
    return datalayer, e


def test_forget_sent_drops_only_an_unsettled_record() -> None:
    now = [10.0]
    datalayer, e = one_endpoint(now)
    a = datalayer.record_sent(e, 100)
    now[0] = 11.0
    b = datalayer.record_sent(e, 200)
    datalayer.update("e:1", Metrics(running=1, updated_at=10.5))  # covers a, not b
    assert (e.unreported_requests, e.unreported_tokens) == (1, 200)
    now[0] = 12.0
    datalayer.forget_sent(e, a)  # covered already: its end waits for a report instead
    assert (e.unreported_requests, e.unreported_tokens, e.unreported_ends) == (1, 200, 1)
    datalayer.forget_sent(e, b)
    assert (e.unreported_requests, e.unreported_tokens, e.unreported_ends) == (0, 0, 1)
    datalayer.update("e:1", Metrics(updated_at=11.9))  # sampled before the end
    assert e.unreported_ends == 1
    datalayer.update("e:1", Metrics(updated_at=12.1))
    assert e.unreported_ends == 0


def test_an_end_a_later_report_already_left_out_is_not_taken_off_again() -> None:
    # The access log reports an end up to a flush interval after it: a report sampled in
    # between shows the request gone already.
    now = [10.0]
    datalayer, e = one_endpoint(now)
    a = datalayer.record_sent(e, 100)
    b = datalayer.record_sent(e, 100)
    c = datalayer.record_sent(e, 100)
    datalayer.update("e:1", Metrics(running=3, updated_at=11.0))
    datalayer.update("e:1", Metrics(running=2, updated_at=12.0))  # a ended at 11.5
    now[0] = 12.04
    datalayer.forget_sent(e, a, ended_at=11.5)
    assert e.unreported_ends == 0
    datalayer.forget_sent(e, c, ended_at=12.03)  # after the latest report: still counted
    datalayer.forget_sent(e, b, ended_at=12.01)  # reported out of order
    assert list(e.ended) == [12.01, 12.03] and e.unreported_ends == 2
    datalayer.update("e:1", Metrics(running=1, updated_at=12.02))
    assert list(e.ended) == [12.03] and e.unreported_ends == 1


async def test_an_access_log_end_is_dated_by_its_duration() -> None:
    router, _, addresses = default_router()
    holder = endpoint(router, addresses[0])
    datalayer = router.datalayer
    clock = datalayer.clock
    first = request(1, logged=True)
    await router.route(first, None)
    router.request_finished(first, RequestOutcome(endpoint="", ok=False, seen_end=False))
    datalayer.clock = lambda: clock() + 1.0  # a report covering the send shows it running
    datalayer.update(addresses[0], Metrics(running=1, max_tokens=500_000, block_size=16,
                                           updated_at=datalayer.clock()))
    datalayer.clock = lambda: clock() + 2.0  # it ended at 1.5 s; the next report shows that
    datalayer.update(addresses[0], Metrics(running=0, max_tokens=500_000, block_size=16,
                                           updated_at=datalayer.clock()))
    datalayer.clock = lambda: clock() + 2.05  # its log entry arrives after that report
    router.request_logged(LoggedEnd("r1", grpc_status=0, http_status=200, usage={},
                                    duration=1.5))
    assert holder.in_flight == 0 and holder.unreported_ends == 0


def test_end_prefill_drops_one_request_of_a_shared_last_block() -> None:
    now = [0.0]
    index = KvBlockIndex(16, clock=lambda: now[0])
    index.add_endpoint("e")
    first = index.await_prefill("e", [7], 300, ttl=30.0)
    index.await_prefill("e", [7], 100, ttl=30.0)  # the same prompt again
    short = index.await_prefill("e", [9], 50, ttl=30.0)
    assert (index.pending_prefill("e"), index.prefilling_requests("e")) == (450, 3)
    index.end_prefill(first)
    assert (index.pending_prefill("e"), index.prefilling_requests("e")) == (150, 2)
    index.end_prefill(short)
    index.end_prefill(short)  # ended twice: nothing more
    assert (index.pending_prefill("e"), index.prefilling_requests("e")) == (100, 1)
    assert index.pending == {"e": 100} and index.prefilling == {"e": 1}
    now[0] = 31.0  # every TTL is up: the ended ones are not taken off again
    index.await_prefill("e", [11], 10, ttl=30.0)
    assert (index.pending_prefill("e"), index.prefilling_requests("e")) == (10, 1)
    assert index.await_prefill("e", [12], 0, ttl=30.0) is None  # nothing to prefill


def test_an_ended_prefill_never_ends_another_awaiting_the_same_block() -> None:
    now = [0.0]
    index = KvBlockIndex(16, clock=lambda: now[0])
    index.add_endpoint("e")
    first = index.await_prefill("e", [7], 300, ttl=30.0)
    now[0] = 10.0
    index.await_prefill("e", [7], 100, ttl=30.0)  # the same prompt, routed later
    index.end_prefill(first)  # the first ends early (its answer came before the batch)
    now[0] = 31.0  # the first's ttl passes: the second, due at 40, still counts
    index.expire()
    assert (index.pending_prefill("e"), index.prefilling_requests("e")) == (100, 1)
    now[0] = 40.0
    index.expire()
    assert index.pending_prefill("e") == 0
    # Stored, then the same prompt awaited again (its blocks since evicted): the first
    # request's ttl does not end the second's count.
    ids = list(range(1, 33))
    last = index.block_hashes(ids)[-1]
    index.await_prefill("e", [last], 32, ttl=30.0)
    index.apply("e", [stored(ids)])
    assert index.pending_prefill("e") == 0
    now[0] = 50.0
    index.await_prefill("e", [last], 32, ttl=30.0)
    now[0] = 70.0  # the first's ttl (due at 70) passes; the second's is due at 80
    index.expire()
    assert (index.pending_prefill("e"), index.prefilling_requests("e")) == (32, 1)
