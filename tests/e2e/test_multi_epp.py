"""Several EPPs behind one Envoy, active-active: any of them routes any request, each ends the
requests it routed from its own access-log entries, and a killed one costs no request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvswitch.launcher import epp_name
from tests.support.gateway import (
    BLOCK,
    CALL_TIMEOUT,
    Gateway,
    cached_on,
    epp_samples,
    generate,
    kill,
    prompt,
    running_gateway,
)

POLL = 0.05
POLLS = 200  # bounded waits: 200 x 50 ms


def _wait_until(condition: object) -> bool:
    waiter = threading.Event()
    for _ in range(POLLS):
        if condition():  # type: ignore[operator]
            return True
        waiter.wait(POLL)
    return bool(condition())  # type: ignore[operator]


def _epps(gw: Gateway) -> range:
    return range(gw.launched.spec.epp_replicas)


def _routed(gw: Gateway, epp: int) -> float:
    return sum(epp_samples(gw, "kvswitch_epp_requests_total", epp=epp, status="200"))


def _finished_ok(gw: Gateway, epp: int) -> float:
    return sum(epp_samples(gw, "kvswitch_epp_requests_finished_total", epp=epp, ok="true"))


def _in_flight(gw: Gateway, epp: int) -> float:
    return sum(epp_samples(gw, "kvswitch_epp_endpoint_in_flight_requests", epp=epp))


def _indexed(gw: Gateway, epp: int, endpoint: str) -> float:
    """-1 while the EPP's metrics port does not answer (it is restarting)."""
    try:
        samples = epp_samples(gw, "kvswitch_epp_indexed_kv_blocks", epp=epp, endpoint=endpoint)
    except OSError:
        return -1.0
    return sum(samples)


@pytest.fixture(scope="module")
def three_epps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(tmp_path_factory.mktemp("three-epps"), replicas=4, profile="tiny",
                         time_scale=100.0, mode="echo", grace_period=1.0,
                         epp_replicas=3) as gw:
        yield gw


def test_every_epp_routes_and_ends_the_requests_it_routed(three_epps: Gateway) -> None:
    gw = three_epps
    with ThreadPoolExecutor(8) as pool:
        completes = list(pool.map(lambda seed: generate(gw.stub, prompt(seed), max_tokens=4),
                                  range(200, 260)))
    assert all(c.completion_tokens == 4 for c in completes)
    # Envoy spreads ext_proc streams over the EPPs (least request): each routed some.
    routed = [_routed(gw, epp) for epp in _epps(gw)]
    assert all(r > 0 for r in routed), routed
    # Each EPP's own access logger brings it the ends of exactly its requests: every request
    # ends as answered OK (not "unknown"), on the EPP that routed it, and nothing stays in flight.
    assert _wait_until(lambda: [_finished_ok(gw, e) for e in _epps(gw)] == routed), (
        [_finished_ok(gw, e) for e in _epps(gw)], routed)
    assert all(_in_flight(gw, epp) == 0 for epp in _epps(gw))


def test_a_prefix_group_stays_on_one_engine_whichever_epp_routes(three_epps: Gateway) -> None:
    gw = three_epps
    # A prefix long enough that its cache hit outweighs the few requests each EPP has just sent
    # there and no load report shows yet (they are load until one does).
    shared = prompt(300, blocks=16)
    first = generate(gw.stub, [*shared, *prompt(301, blocks=1)])
    assert first.cached_tokens == 0
    (holder,) = cached_on(gw.engines, shared)
    # Every EPP learns the blocks from the holder's KV events (each subscribes on its own).
    assert _wait_until(lambda: all(_indexed(gw, e, holder) >= len(shared) // BLOCK
                                   for e in _epps(gw)))
    for seed in range(302, 314):  # ~4 per EPP
        again = generate(gw.stub, [*shared, *prompt(seed, blocks=1)])
        # Only the holder has all of `shared` (the probe left one block on the others).
        assert again.cached_tokens >= len(shared), again


@pytest.fixture
def doomed_epps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Two EPPs on a real-time clock; the test kills one, the supervisor restarts it."""
    with running_gateway(tmp_path_factory.mktemp("epp-failover"), replicas=2, profile="tiny",
                         time_scale=1.0, mode="echo", grace_period=1.0, epp_replicas=2,
                         restart_epp=True) as gw:
        yield gw


def test_a_killed_epp_loses_no_request_and_its_restart_rejoins(doomed_epps: Gateway) -> None:
    gw = doomed_epps
    victim = gw.supervisor.get(epp_name(0, 2))
    old_pid = victim.pid
    errors: list[grpc.RpcError] = []
    done = threading.Event()

    def client(worker: int) -> int:
        sent = 0
        for i in range(400):  # bounded; stops early once the kill is over and checked
            if done.is_set() and i > 20:
                break
            try:
                generate(gw.stub, prompt(1000 + worker * 1000 + i), max_tokens=2)
            except grpc.RpcError as exc:
                errors.append(exc)
            sent += 1
        return sent

    with ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client, w) for w in range(4)]
        assert _wait_until(lambda: _routed(gw, 0) >= 20)  # under load, through both EPPs
        kill(old_pid)
        # The survivor takes every new request while the victim is down.
        before = _routed(gw, 1)
        assert _wait_until(lambda: _routed(gw, 1) >= before + 40)
        done.set()
        sent = sum(c.result(timeout=CALL_TIMEOUT * 4) for c in clients)
    assert sent > 0
    assert not errors, [(e.code(), e.details()) for e in errors[:5]]
    # The supervisor restarts it; it rebuilds its index from the engines' KV-event history
    # and Envoy sends it requests again once its health check passes.
    assert _wait_until(lambda: bool(gw.supervisor.poll()) or victim.pid != old_pid)
    assert victim.pid != old_pid
    engine = gw.engines[0]
    assert _wait_until(lambda: _indexed(gw, 0, engine) == _indexed(gw, 1, engine) > 0)
    # Envoy lets it back in once its health check passes and an ejection has run out.
    seeds = iter(range(9000, 9000 + POLLS + 1))

    def routed_by_the_restarted_epp() -> bool:
        generate(gw.stub, prompt(next(seeds)), max_tokens=2)
        return _routed(gw, 0) > 0

    assert _wait_until(routed_by_the_restarted_epp)
