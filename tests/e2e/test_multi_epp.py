"""Several EPPs behind one Envoy, active-active: any of them routes any request, each ends the
requests it routed from its own access-log entries, a killed one costs no request, and each
learns of the others' sends, and the prompts they queued, from the engines' load pushes (on
either engine API)."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import grpc
import pytest

from kvswitch.launcher import epp_name
from kvswitch.protocol import vllm_engine_pb2_grpc as rpc
from kvswitch.protocol.sglang import sglang_scheduler_pb2 as sglang_pb
from kvswitch.protocol.sglang import sglang_scheduler_pb2_grpc as sglang_rpc
from tests.support.certs import tls_dir
from tests.support.gateway import (
    BLOCK,
    CALL_TIMEOUT,
    Gateway,
    cached_on,
    epp_metrics,
    epp_samples,
    generate,
    generate_request,
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


def _speculative(gw: Gateway, epp: int, endpoint: str) -> float:
    return sum(epp_samples(gw, "kvswitch_epp_speculative_kv_blocks", epp=epp, endpoint=endpoint))


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
        # One block each: the tiny engines' 64-block caches keep room for the tests after this.
        completes = list(pool.map(
            lambda seed: generate(gw.stub, prompt(seed, blocks=1), max_tokens=4),
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


def test_every_epp_answers_the_kubelets_probes_on_its_metrics_port(three_epps: Gateway) -> None:
    # (the chart's probes: the ext_proc port may serve TLS, which the kubelet cannot probe)
    for epp in _epps(three_epps):
        port = three_epps.launched.ports.epp_metrics[epp]
        for path, body in (("/health", b"ok\n"), ("/ready", b"ready\n")):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
                assert (reply.status, reply.read()) == (200, body)


def test_envoy_reaches_several_epps_over_mtls(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The shape the Helm chart runs with a TLS Secret and several EPPs: every hop to the EPPs
    (ext_proc, Envoy's health checks, each EPP's access log) over mTLS."""
    tls = tls_dir(tmp_path_factory.mktemp("epp-tls"))
    with running_gateway(tmp_path_factory.mktemp("epps-tls"), replicas=2, profile="tiny",
                         time_scale=100.0, mode="echo", grace_period=1.0, epp_replicas=2,
                         tls=tls) as gw:
        files = tls.client()
        credentials = grpc.ssl_channel_credentials(files.ca.read_bytes())
        with grpc.secure_channel(f"localhost:{gw.launched.ports.public}", credentials) as channel:
            stub = rpc.VllmEngineStub(channel)
            with ThreadPoolExecutor(4) as pool:
                completes = list(pool.map(lambda seed: generate(stub, prompt(seed), max_tokens=2),
                                          range(700, 740)))
        assert all(c.completion_tokens == 2 for c in completes)
        # Both EPPs pass Envoy's health checks and route; each receives its access-log entries.
        routed = [_routed(gw, epp) for epp in _epps(gw)]
        assert all(r > 0 for r in routed), routed
        assert _wait_until(lambda: [_finished_ok(gw, e) for e in _epps(gw)] == routed)


def test_a_prefix_group_stays_on_one_engine_whichever_epp_routes(three_epps: Gateway) -> None:
    gw = three_epps
    # A prefix long enough that its cache hit outweighs the few requests each EPP has just sent
    # there and no load report shows yet (they are load until one does).
    shared = prompt(300, blocks=16)
    # Earlier tests' blocks are indexed too: wait for this prompt's on top of them.
    before = {(e, a): _indexed(gw, e, a) for e in _epps(gw) for a in gw.engines}
    first = generate(gw.stub, [*shared, *prompt(301, blocks=1)])
    assert first.cached_tokens == 0
    (holder,) = cached_on(gw.engines, shared)
    # Every EPP learns the blocks from the holder's KV events (each subscribes on its own).
    assert _wait_until(lambda: all(
        _indexed(gw, e, holder) >= before[e, holder] + len(shared) // BLOCK for e in _epps(gw)))
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


class LoadView(NamedTuple):
    """What one EPP knows of an engine's load, from one scrape of its metrics."""

    reported: float
    """Running + waiting requests in the engine's latest load report."""
    unreported: float
    """Requests this EPP sent there that no report covers yet."""
    batch_records: float
    load_only_records: float


def _view(gw: Gateway, epp: int, engine: str) -> LoadView:
    samples = epp_metrics(gw, epp)
    requests = {s.labels["state"]: s.value for s in samples
                if s.name == "kvswitch_epp_endpoint_requests" and s.labels["endpoint"] == engine}
    records = {s.labels["kind"]: s.value for s in samples
               if s.name == "kvswitch_epp_load_records_total" and s.labels["endpoint"] == engine}
    return LoadView(requests["running"] + requests["waiting"], requests["unreported"],
                    records["batch"], records["load_only"])


PUSH_DEADLINE = 0.5
"""Seconds the EPPs get to see a send: half the heartbeat period (1 s), far less than the
engine's coalescing window here, and a hundred times the push interval (5 ms)."""


@pytest.fixture
def pushing_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One engine on a slow clock (a request runs for seconds) whose KV-event batches coalesce
    over ten minutes, behind two EPPs: within the test only a load push (or a heartbeat, 1 s
    after the stream's last record) can bring an arrival's load on the stream. It runs one
    request at a time: the next one queues."""
    with running_gateway(tmp_path_factory.mktemp("load-push"), replicas=1, profile="tiny",
                         time_scale=0.005, mode="echo", grace_period=1.0, epp_replicas=2,
                         engine_args=("--kv-events-coalesce-ms", "600000",
                                      "--max-num-seqs", "1")) as gw:
        yield gw


def test_every_epp_learns_of_another_epps_send_from_the_engines_load_push(
        pushing_engine: Gateway) -> None:
    gw = pushing_engine
    (engine,) = gw.engines
    epps = _epps(gw)

    def views() -> list[LoadView]:
        return [_view(gw, e, engine) for e in epps]

    # Each EPP follows the engine's stream (its opening record, then a heartbeat a second
    # later: by then the engine counts both subscribers and pushes).
    assert _wait_until(lambda: all(v.load_only_records >= 2 for v in views()))
    calls = []
    try:
        # The first request opens the engine's coalescing window (a quiet engine's first batch
        # goes out at once): both EPPs receive that batch and see the request.
        calls.append(gw.stub.Generate(generate_request(prompt(500), max_tokens=900),
                                      timeout=CALL_TIMEOUT))
        assert _wait_until(lambda: all(v.batch_records == 1 and v.reported == 1
                                       for v in views()))
        routed = [_routed(gw, e) for e in epps]
        before = views()
        # The second request arrives inside the window: no batch can bring its load now, and
        # the streams' next heartbeat is a second after that batch.
        sent = time.monotonic()
        calls.append(gw.stub.Generate(generate_request(prompt(501), max_tokens=900),
                                      timeout=CALL_TIMEOUT))

        def every_epp_saw_it(now: list[LoadView]) -> bool:
            # The sender may still count its send too, until a report sampled its transit
            # allowance (5 ms) after the send: the push comes 1 ms after the arrival.
            return sum(v.unreported for v in now) <= 1 and all(
                v.reported == 2 and v.load_only_records > b.load_only_records
                for v, b in zip(now, before, strict=True))

        waiter = threading.Event()
        while not every_epp_saw_it(now := views()) and time.monotonic() - sent < PUSH_DEADLINE:
            waiter.wait(0.01)
        # One EPP routed it; the other learnt of it from a load-only record (the push), within
        # the deadline.
        assert every_epp_saw_it(now), (time.monotonic() - sent, before, now)
        assert sum(_routed(gw, e) for e in epps) == sum(routed) + 1
        assert [v.batch_records for v in now] == [1, 1]
        # The push also named its prompt: the EPP that did not route it holds the prompt's
        # blocks on the engine speculatively too, though no KV event has stored them yet.
        blocks = len(prompt(501)) // BLOCK
        assert [_speculative(gw, e, engine) for e in epps] == [blocks, blocks]
    finally:
        for call in calls:
            call.cancel()


def _pending(gw: Gateway, epp: int, endpoint: str) -> float:
    return sum(epp_samples(gw, "kvswitch_epp_pending_prefill_tokens", epp=epp,
                           endpoint=endpoint))


@pytest.fixture
def pushing_sglang_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """`pushing_engine` on SGLang's API, its radix cache published in pages of one token."""
    with running_gateway(tmp_path_factory.mktemp("load-push-sglang"), replicas=1, profile="tiny",
                         time_scale=0.005, mode="echo", grace_period=1.0, epp_replicas=2,
                         api="sglang",
                         engine_args=("--page-size", "1", "--kv-events-coalesce-ms", "600000",
                                      "--max-num-seqs", "1")) as gw:
        yield gw


def _start(gw: Gateway, api: str, ids: list[int]) -> grpc.Future:
    """A long generation through the gateway on the pool's engine API (900 tokens)."""
    if api == "sglang":
        return sglang_rpc.SglangSchedulerStub(gw.channel).Generate(sglang_pb.GenerateRequest(
            request_id=f"sg-{ids[0]}", tokenized=sglang_pb.TokenizedInput(input_ids=ids),
            sampling_params=sglang_pb.SamplingParams(max_new_tokens=900, ignore_eos=True,
                                                     temperature=1.0, top_p=1.0)),
            timeout=CALL_TIMEOUT)
    return gw.stub.Generate(generate_request(ids, max_tokens=900), timeout=CALL_TIMEOUT)


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_a_request_cancelled_while_queued_stops_counting_on_every_epp(
        api: str, request: pytest.FixtureRequest) -> None:
    # On SGLang's API the push announces whole engine blocks, which each EPP cuts into its own:
    # the EPP that did not route a prompt counts its tokens as the one that did.
    gw: Gateway = request.getfixturevalue(
        "pushing_engine" if api == "vllm" else "pushing_sglang_engine")
    (engine,) = gw.engines
    epps = _epps(gw)
    assert _wait_until(lambda: all(_view(gw, e, engine).load_only_records >= 2 for e in epps))
    running, queued = prompt(600), prompt(601)
    calls = [_start(gw, api, running)]
    try:
        # No KV event stores a block within the test (the window is ten minutes): each prompt
        # counts as prefill in progress on both EPPs, by its route or by the push naming it.
        assert _wait_until(lambda: [_pending(gw, e, engine) for e in epps] == [len(running)] * 2)
        calls.append(_start(gw, api, queued))
        both = len(running) + len(queued)
        assert _wait_until(lambda: [_pending(gw, e, engine) for e in epps] == [both] * 2)
        assert _view(gw, 0, engine).reported == 2  # one running, one waiting for the seat
        calls.pop().cancel()
        # The EPP that routed it ends it from its access log; the other from the engine's push
        # withdrawing it (without, it would count it for prefillTtl, 30 s).
        assert _wait_until(lambda: [_pending(gw, e, engine) for e in epps] == [len(running)] * 2)
    finally:
        for call in calls:
            call.cancel()
