"""The director end to end, in process: config -> router, endpoints fed directly."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter

import pytest
from prometheus_client import generate_latest

from kvswitch.epp.config import build_endpoint_picker, static_pool
from kvswitch.epp.contracts import RequestOutcome, RoutingDecision
from kvswitch.epp.datalayer import Metrics
from kvswitch.epp.metrics import EppMetrics
from kvswitch.epp.router import EppRouter
from tests.support.router import ADDRS, config, make_router, prompt, request, set_load
from tests.support.waiting import until


async def test_same_prefix_sticks_while_different_prefixes_spread() -> None:
    router = make_router()
    groups = [prompt(g, 512) for g in range(16)]
    where: dict[int, set[str]] = {}
    for round_ in range(4):
        for g, prefix in enumerate(groups):
            tail = prompt(1000 + round_ * 100 + g, 64)
            decision = await router.route(request(prefix + tail), None)
            where.setdefault(g, set()).add(decision.endpoints[0])
    assert all(len(eps) == 1 for eps in where.values())  # every group stayed on one endpoint
    assert len({next(iter(eps)) for eps in where.values()}) >= 3  # groups spread (random ties)


async def test_load_overrides_a_weak_prefix_match() -> None:
    router = make_router()
    base = prompt(1)
    first = (await router.route(request(base), None)).endpoints[0]
    # Only the first 8 of 64 blocks are shared: prefix score 0.125 * 3 = 0.375.
    weak = base[:128] + prompt(2, 896)
    set_load(router, first, waiting=10)
    # first: 3 * 0.125 + 2 * 0 (longest queue) + 2 * 1 = 2.375 < others: 0 + 2 + 2 = 4.
    assert (await router.route(request(weak), None)).endpoints[0] != first
    # A full match still wins against that load: 3 * 1 + 0 + 2 = 5 > 4.
    assert (await router.route(request(base), None)).endpoints[0] == first


async def test_fallbacks_come_in_score_order() -> None:
    cfg = config(plugins=[{"type": "queue-scorer"},
                          {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 3}}])
    router = make_router(cfg)
    for i, a in enumerate(ADDRS):
        set_load(router, a, waiting=[4, 0, 8, 2][i])
    decision = await router.route(request(prompt(3)), None)
    assert decision.endpoints == (ADDRS[1], ADDRS[3], ADDRS[0])


async def test_subset_hint_limits_the_choice_or_503s() -> None:
    router = make_router()
    for _ in range(10):
        assert (await router.route(request(prompt(4)), [ADDRS[2]])).endpoints == (ADDRS[2],)
    assert (await router.route(request(prompt(4)), ["127.0.0.1"])).status == 200  # ip only
    assert await router.route(request(prompt(4)), ["10.9.9.9:1"]) == RoutingDecision(
        status=503, reason="no eligible endpoint in subset")


async def test_no_ready_endpoint_is_503() -> None:
    router = make_router()
    for a in ADDRS:
        router.datalayer.mark_failed(a)
    assert await router.route(request(prompt(5)), None) == RoutingDecision(
        status=503, reason="no ready endpoint")
    set_load(router, ADDRS[3])  # it recovers
    assert (await router.route(request(prompt(5)), None)).endpoints == (ADDRS[3],)


async def test_stale_endpoint_is_excluded_then_back() -> None:
    router = make_router()
    router.datalayer.staleness = 0.5
    set_load(router, ADDRS[0])
    for a in ADDRS[1:]:
        router.datalayer.update(a, Metrics(updated_at=router.datalayer.clock() - 1.0))
    picks = {(await router.route(request(prompt(i)), None)).endpoints[0] for i in range(20)}
    assert picks == {ADDRS[0]}
    set_load(router, ADDRS[0])
    set_load(router, ADDRS[1])
    picks = {(await router.route(request(prompt(100 + i)), None)).endpoints[0]
             for i in range(40)}
    assert picks == {ADDRS[0], ADDRS[1]}


OBJECTIVES = [{"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
               "kind": "InferenceObjective", "metadata": {"name": "batch"},
               "spec": {"priority": -1}}]


async def test_saturated_pool_sheds_sheddable_with_429_and_queues_the_rest() -> None:
    router = make_router(config(featureGates=["flowControl"],
                                flowControl={"maxWait": "5s"}), objectives=OBJECTIVES)
    for a in ADDRS:
        set_load(router, a, waiting=6)
    shed = await router.route(request(prompt(6), objective="batch"), None)
    assert (shed.status, shed.reason) == (429, "pool saturated: sheddable request shed")
    waiting = asyncio.ensure_future(router.route(request(prompt(7)), None))
    await asyncio.sleep(0.02)
    assert not waiting.done()
    set_load(router, ADDRS[2], waiting=0)
    router.gate.pump()
    assert (await waiting).endpoints == (ADDRS[2],)


async def test_in_flight_counts_and_usage_metrics() -> None:
    router = make_router()
    req = dataclasses.replace(request(prompt(8), fairness_id="tenant-a"), objective="batch",
                              received_at=time.monotonic() - 0.3)
    decision = await router.route(req, None)
    where = decision.endpoints[0]
    assert router.in_flight()[where] == 1
    router.request_finished(req, RequestOutcome(where, ok=True, grpc_status=0, prompt_tokens=1024,
                                                completion_tokens=10, cached_tokens=512))
    router.request_finished(req, RequestOutcome(where, ok=True))  # once per request: ignored
    assert router.in_flight()[where] == 0
    m = router.metrics
    labels = ("", "batch", "tenant-a", where)
    assert m.prompt_tokens.value(*labels) == 1024
    assert m.completion_tokens.value(*labels) == 10
    assert m.cached_tokens.value(*labels) == 512
    assert m.finished.value(*labels, "true", "OK") == 1
    assert m.request_seconds.count(*labels) == 1
    assert 0.3 <= m.request_seconds.series[labels][1] < 5
    router.update_gauges()
    text = generate_latest(m.registry).decode()
    assert (f'kvswitch_epp_cached_tokens_total{{endpoint="{where}",fairness_id="tenant-a",'
            f'model="",objective="batch"}} 512.0') in text
    assert (f'kvswitch_epp_request_duration_seconds_bucket{{endpoint="{where}",'
            f'fairness_id="tenant-a",le="0.5",model="",objective="batch"}} 1.0') in text
    assert "kvswitch_epp_pool_ready_endpoints 4.0" in text
    assert "kvswitch_epp_scheduler_e2e_duration_seconds_count 1.0" in text
    assert 'status="200"' in text


def _endpoint_series(router: EppRouter, name: str) -> dict[str, float]:
    return {sample.labels["endpoint"]: sample.value
            for family in router.metrics.registry.collect() if family.name == name
            for sample in family.samples}


def _in_flight_series(router: EppRouter) -> dict[str, float]:
    return _endpoint_series(router, "kvswitch_epp_endpoint_in_flight_requests")


async def test_in_flight_gauge_exports_never_picked_endpoints_from_the_start() -> None:
    addrs = ["127.0.0.1:1", "127.0.0.1:2"]  # unreachable: never ready, never picked
    router = build_endpoint_picker(None, static_pool(addrs), metrics=EppMetrics()).router
    await router.start()
    try:
        await asyncio.sleep(0)  # the gauge task's first tick
        text = generate_latest(router.metrics.registry).decode()
    finally:
        await router.stop()
    for address in addrs:
        assert f'kvswitch_epp_endpoint_in_flight_requests{{endpoint="{address}"}} 0.0' in text


async def test_in_flight_gauge_follows_picks_and_keeps_a_removed_endpoint_while_busy() -> None:
    router = make_router()
    router.update_gauges()
    assert _in_flight_series(router) == dict.fromkeys(ADDRS, 0.0)
    first = await router.route(req_a := request(prompt(30)), None)
    second = await router.route(req_b := request(prompt(30)), None)  # same prefix: same pick
    where = first.endpoints[0]
    assert second.endpoints[0] == where
    assert _in_flight_series(router) == {**dict.fromkeys(ADDRS, 0.0), where: 2.0}
    router.request_finished(req_a, RequestOutcome(where, ok=True))
    assert _in_flight_series(router)[where] == 1.0
    # The endpoint leaves the pool with a request in flight: its series stays, and follows it.
    specs = router.refresher.discovery.endpoints  # type: ignore[union-attr]
    router.datalayer.set_endpoints([s for s in specs if s.address != where])
    router.update_gauges()
    assert _in_flight_series(router) == {**dict.fromkeys(ADDRS, 0.0), where: 1.0}
    router.request_finished(req_b, RequestOutcome(where, ok=True))
    assert _in_flight_series(router)[where] == 0.0
    router.update_gauges()  # idle and out of the pool: gone at the next tick
    assert _in_flight_series(router) == {a: 0.0 for a in ADDRS if a != where}
    # Back in the pool (a new endpoint object): exported again.
    router.datalayer.set_endpoints(specs)
    router.update_gauges()
    assert _in_flight_series(router) == dict.fromkeys(ADDRS, 0.0)


async def test_endpoint_ready_gauge_follows_the_pool_and_drops_an_endpoint_that_left() -> None:
    router = make_router()
    failed = ADDRS[1]
    router.datalayer.mark_failed(failed)
    router.update_gauges()
    ready = "kvswitch_epp_endpoint_ready"
    assert _endpoint_series(router, ready) == {**dict.fromkeys(ADDRS, 1.0), failed: 0.0}
    gone = ADDRS[0]
    specs = router.refresher.discovery.endpoints  # type: ignore[union-attr]
    router.datalayer.set_endpoints([s for s in specs if s.address != gone])
    router.update_gauges()  # no series left behind with its last value (1)
    assert _endpoint_series(router, ready) == {**dict.fromkeys(ADDRS[1:], 1.0), failed: 0.0}


async def test_outcome_status_names_and_the_prompt_length_without_a_usage_trailer() -> None:
    router = make_router()
    outcomes = [RequestOutcome("", ok=True, grpc_status=0),  # no usage trailer (real vLLM)
                RequestOutcome("", ok=False, grpc_status=14),
                RequestOutcome("", ok=False),  # the stream broke before any answer
                RequestOutcome("", ok=False, http_status=503)]
    for i, outcome in enumerate(outcomes):
        req = request(prompt(i, 100))
        if i == 3:
            req = dataclasses.replace(req, protocol="http")
        where = (await router.route(req, None)).endpoints[0]
        router.request_finished(req, dataclasses.replace(outcome, endpoint=where))
    finished = router.metrics.finished.values
    assert sorted((labels[-2], labels[-1]) for labels in finished) == [
        ("false", "503"), ("false", "UNAVAILABLE"), ("false", "unknown"), ("true", "OK")]
    # Only the request answered OK counts its tokenized prompt; failures count none.
    assert sum(router.metrics.prompt_tokens.values.values()) == 100


async def test_start_and_stop_with_unreachable_endpoints() -> None:
    router = build_endpoint_picker(None, static_pool(["127.0.0.1:1"]), metrics=EppMetrics()).router
    await router.start()
    try:
        await until(lambda: any(e.failures for e in router.datalayer.all()))  # a refresh failed
        decision = await router.route(request(prompt(9)), None)
        assert (decision.status, decision.reason) == (503, "no ready endpoint")
    finally:
        await router.stop()


async def test_event_loop_lag_is_measured_and_reported() -> None:
    router = build_endpoint_picker(None, static_pool(["127.0.0.1:1"]), metrics=EppMetrics()).router
    router.lag_interval = 0.01
    await router.start()
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.05)  # noqa: ASYNC251 - block the loop: the next timer wakes up ~50 ms late
        await asyncio.sleep(0.05)
        router.update_gauges()
    finally:
        await router.stop()
    text = generate_latest(router.metrics.registry).decode()
    lag = next(float(line.split()[1]) for line in text.splitlines()
               if line.startswith("kvswitch_epp_event_loop_lag_max_seconds "))
    assert 0.03 < lag < 1.0
    assert "kvswitch_epp_event_loop_lag_seconds_count" in text


@pytest.mark.parametrize("picker", ["round-robin-picker", "random-picker"])
async def test_baseline_pickers_ignore_prefixes(picker: str) -> None:
    router = make_router(config(plugins=[{"type": picker}]))
    base = prompt(10)
    picks = Counter([(await router.route(request(base), None)).endpoints[0] for _ in range(40)])
    assert len(picks) == 4


async def test_router_starts_and_stops_plugin_subscriptions() -> None:
    cfg = config(plugins=[{"type": "precise-prefix-cache-scorer",
                           "parameters": {"tokenizer": "none"}}])
    router = build_endpoint_picker(cfg, static_pool(["127.0.0.1:1", "127.0.0.1:2"]),
                                   metrics=EppMetrics()).router
    assert isinstance(router, EppRouter)
    scorer = next(p for p in router.scheduler.plugins
                  if getattr(p, "name", "") == "precise-prefix-cache-scorer")
    await router.start()
    try:
        # Started with the router, before any request: one subscription per pool endpoint.
        assert (set(scorer.subscriptions.subscribers)  # type: ignore[attr-defined]
                == {"127.0.0.1:1", "127.0.0.1:2"})
        tasks = [s._task
                 for s in scorer.subscriptions.subscribers.values()]  # type: ignore[attr-defined]
    finally:
        await router.stop()
    assert scorer.subscriptions.subscribers == {}  # type: ignore[attr-defined]
    assert all(t is not None and t.done() for t in tasks)


async def test_readiness_uses_the_data_layer_threshold_not_the_saturation_one() -> None:
    router = make_router(config(dataLayer={"refreshInterval": "50ms"},
                                saturationDetector={"metricsStalenessThreshold": "200ms"}),
                         objectives=OBJECTIVES)
    router.datalayer.staleness = 2.0  # what the config gives (make_router overrides it)
    for a in ADDRS:  # every refresh 1 s late (CPU contention): stale for saturation only
        router.datalayer.update(a, Metrics(updated_at=router.datalayer.clock() - 1.0))
    assert (await router.route(request(prompt(11)), None)).status == 200
    shed = await router.route(request(prompt(12), objective="batch"), None)
    assert shed.status == 429
