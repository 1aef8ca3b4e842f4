"""Flow control: the sans-IO queues with exact inputs, then the asyncio gate."""

from __future__ import annotations

import asyncio

from kvswitch.epp.datalayer import Endpoint, EndpointSpec, Metrics
from kvswitch.epp.flowcontrol import (
    EXPIRED,
    QUEUE_FULL,
    SHED,
    FlowControlConfig,
    FlowGate,
    FlowQueues,
    SaturationConfig,
    Verdict,
    headroom,
    is_saturated,
)
from kvswitch.epp.flowcontrol.core import DISPATCH, QUEUED


def ep(waiting: int = 0, kv: float = 0.0) -> Endpoint:
    e = Endpoint(EndpointSpec("a:1"))
    e.metrics = Metrics(waiting=waiting, kv_usage=kv)
    return e


def test_saturation_needs_every_endpoint_saturated() -> None:
    cfg = SaturationConfig(queue_depth_threshold=5, kv_cache_util_threshold=0.8)
    assert is_saturated([ep(waiting=5), ep(kv=0.9)], cfg)
    assert not is_saturated([ep(waiting=5), ep(waiting=4)], cfg)
    assert headroom([ep(waiting=5), ep(waiting=2), ep(waiting=0)], cfg) == 8


def test_admission_paths() -> None:
    q = FlowQueues(FlowControlConfig(max_queued_per_flow=1))
    assert q.admit(1, "t", 0, saturated=False, now=0.0) == DISPATCH
    assert q.admit(2, "t", -1, saturated=True, now=0.0) == SHED
    assert q.admit(3, "t", 0, saturated=True, now=0.0) == QUEUED
    assert q.admit(4, "t", 0, saturated=True, now=0.0) == QUEUE_FULL
    # Something is queued: even an unsaturated arrival queues behind it (FIFO per flow).
    assert q.admit(5, "u", 0, saturated=False, now=0.0) == QUEUED
    assert q.sizes() == {(0, "t"): 1, (0, "u"): 1}


def test_without_queueing_only_sheddable_requests_are_dropped() -> None:
    q = FlowQueues(queueing=False)
    assert q.admit(1, "t", 0, saturated=True, now=0.0) == DISPATCH
    assert q.admit(2, "t", -5, saturated=True, now=0.0).verdict is Verdict.REJECTED


def test_release_by_priority_then_round_robin_between_flows() -> None:
    q = FlowQueues()
    for key, flow, prio in [(1, "a", 0), (2, "a", 0), (3, "a", 0), (4, "b", 0), (5, "b", 0),
                            (6, "c", 5)]:
        q.admit(key, flow, prio, saturated=True, now=0.0)
    assert q.release(10) == [6, 1, 4, 2, 5, 3]
    assert len(q) == 0


def test_weighted_fairness_gives_consecutive_turns() -> None:
    q = FlowQueues(FlowControlConfig(fairness="weighted", fairness_weights={"a": 2}))
    for key, flow in [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "b")]:
        q.admit(key, flow, 0, saturated=True, now=0.0)
    assert q.release(2) == [1, 2]
    assert q.release(10) == [4, 3, 5]


def test_expiry_and_removal() -> None:
    q = FlowQueues(FlowControlConfig(max_wait=1.0))
    q.admit(1, "a", 0, saturated=True, now=0.0)
    q.admit(2, "a", 0, saturated=True, now=0.5)
    q.admit(3, "b", 0, saturated=True, now=0.6)
    assert q.expire(1.2) == [1]
    q.remove(3)
    assert q.sizes() == {(0, "a"): 1}


async def test_gate_queues_until_headroom_then_dispatches() -> None:
    endpoints = [ep(waiting=5)]
    gate = FlowGate(lambda: endpoints, SaturationConfig(queue_depth_threshold=5))
    assert await gate.admit("t", -1, endpoints) == SHED
    waiter = asyncio.ensure_future(gate.admit("t", 0, endpoints))
    await asyncio.sleep(0.01)
    assert not waiter.done() and len(gate.queues) == 1
    gate.pump()
    assert not waiter.done()  # still saturated
    endpoints[0].metrics = Metrics(waiting=1)
    gate.pump()
    assert (await waiter) == DISPATCH


async def test_gate_expires_waiters_with_503() -> None:
    endpoints = [ep(kv=0.95)]
    gate = FlowGate(lambda: endpoints, config=FlowControlConfig(max_wait=0.05), tick=0.01)
    await gate.start()
    try:
        admission = await asyncio.wait_for(gate.admit("t", 0, endpoints), 2.0)
    finally:
        await gate.stop()
    assert admission == EXPIRED and admission.status == 503


async def test_cancelled_waiter_leaves_the_queue() -> None:
    endpoints = [ep(waiting=9)]
    gate = FlowGate(lambda: endpoints)
    waiter = asyncio.ensure_future(gate.admit("t", 0, endpoints))
    await asyncio.sleep(0.01)
    waiter.cancel()
    await asyncio.sleep(0.01)
    assert len(gate.queues) == 0


def test_stale_metrics_count_as_saturated_only_when_shedding() -> None:
    cfg = SaturationConfig(metrics_staleness=0.2)
    stale = ep()
    stale.metrics = Metrics(updated_at=10.0)
    assert not is_saturated([stale], cfg)  # load alone: idle
    assert is_saturated([stale], cfg, now=10.5)  # for shedding: unsure means saturated
    assert not is_saturated([stale], cfg, now=10.1)
    stale.live_until = 11.0  # pushed load records still flowing: current
    assert not is_saturated([stale], cfg, now=10.5)


async def test_gate_sheds_sheddable_on_stale_metrics_but_dispatches_the_rest() -> None:
    now = [10.5]
    stale = ep()
    stale.metrics = Metrics(updated_at=10.0)
    gate = FlowGate(lambda: [stale], SaturationConfig(metrics_staleness=0.2),
                    clock=lambda: now[0])
    assert await gate.admit("t", -1, [stale]) == SHED
    assert await gate.admit("t", 0, [stale]) == DISPATCH


async def test_dispatches_now_only_when_admit_would_dispatch_at_once() -> None:
    endpoints = [ep(waiting=5)]
    now = [10.5]
    gate = FlowGate(lambda: endpoints, SaturationConfig(queue_depth_threshold=5),
                    clock=lambda: now[0])
    assert not gate.dispatches_now(0, endpoints)  # saturated
    waiter = asyncio.ensure_future(gate.admit("t", 0, endpoints))
    await asyncio.sleep(0)
    endpoints.append(ep(waiting=0))
    assert not gate.dispatches_now(0, endpoints)  # headroom, but someone queues first
    gate.pump()
    assert (await waiter) == DISPATCH
    assert gate.dispatches_now(0, endpoints)
    endpoints[1].metrics = Metrics(updated_at=10.0)
    assert gate.dispatches_now(0, endpoints)  # stale metrics matter only for shedding
    assert not gate.dispatches_now(-1, endpoints)
