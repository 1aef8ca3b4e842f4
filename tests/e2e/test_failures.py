"""The gateway when things go wrong: a replica dies, the whole pool is down, the pool saturates."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from kvswitch.launcher import DEFAULT_EPP_CONFIG
from kvswitch.protocol.headers import DESTINATION_SUBSET, DROPPED_REASON, OBJECTIVE
from tests.support.gateway import (
    CALL_TIMEOUT,
    Gateway,
    epp_samples,
    generate,
    generate_request,
    kill,
    prompt,
    running_gateway,
)
from tests.support.processes import free_port


@pytest.fixture(scope="module")
def real_time_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Three tiny engines on a real-time clock, so a long stream is still running when its
    replica is killed (~1 ms per decode step)."""
    with running_gateway(tmp_path_factory.mktemp("kill"), replicas=3, profile="tiny",
                         time_scale=1.0, mode="echo", grace_period=1.0) as gw:
        yield gw


def _endpoint_ready(gw: Gateway, address: str) -> list[float]:
    return epp_samples(gw, "kvswitch_epp_endpoint_ready", endpoint=address)


def _in_flight(gw: Gateway, address: str) -> list[float]:
    return epp_samples(gw, "kvswitch_epp_endpoint_in_flight_requests", endpoint=address)


def test_killed_replica_ends_its_streams_and_gets_no_more_work(real_time_gateway: Gateway) -> None:
    gw = real_time_gateway
    victim = gw.engines[0]
    stream = gw.stub.Generate(generate_request(prompt(1), max_tokens=900, stream=True),
                              metadata=[(DESTINATION_SUBSET, victim)], timeout=CALL_TIMEOUT)
    first = next(stream)
    assert first.HasField("chunk")
    kill(gw.engine_pid(victim))
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    # The stream ends with an error well before its deadline instead of hanging.
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                                 grpc.StatusCode.UNKNOWN)
    # Every later request is served by the survivors (Envoy retries a refused connection on
    # the EPP's fallback; the EPP drops the replica at its next refresh).
    for seed in range(10, 20):
        assert generate(gw.stub, prompt(seed), max_tokens=4).completion_tokens == 4
    stopped = threading.Event()
    for _ in range(100):  # bounded: 100 x 0.05 s
        if _endpoint_ready(gw, victim) == [0.0]:
            break
        stopped.wait(0.05)
    assert _endpoint_ready(gw, victim) == [0.0]


def test_a_stream_counts_in_flight_until_its_response_ends(real_time_gateway: Gateway) -> None:
    # The EPP sees no response message for gRPC pools (its ext_proc stream closes once the
    # request is routed): the count must still last until the response's end, which the
    # gateway's access log reports.
    gw = real_time_gateway
    replica = gw.engines[1]
    stream = gw.stub.Generate(generate_request(prompt(2), max_tokens=900, stream=True),
                              metadata=[(DESTINATION_SUBSET, replica)], timeout=CALL_TIMEOUT)
    assert next(stream).HasField("chunk")
    assert _in_flight(gw, replica) == [1.0]  # mid-stream
    responses = list(stream)
    assert responses[-1].complete.finish_reason == "length"
    stopped = threading.Event()
    for _ in range(100):  # bounded: 100 x 0.05 s (the log is flushed every 50 ms)
        if _in_flight(gw, replica) == [0.0]:
            break
        stopped.wait(0.05)
    assert _in_flight(gw, replica) == [0.0]


@pytest.fixture
def doomed_epp_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A real-time gateway whose EPP the test kills."""
    with running_gateway(tmp_path_factory.mktemp("epp-kill"), replicas=2, profile="tiny",
                         time_scale=1.0, mode="echo", grace_period=1.0) as gw:
        yield gw


def test_streams_in_flight_outlive_the_epp(doomed_epp_gateway: Gateway) -> None:
    gw = doomed_epp_gateway
    stream = gw.stub.Generate(generate_request(prompt(3), max_tokens=900, stream=True),
                              timeout=CALL_TIMEOUT)
    assert next(stream).HasField("chunk")
    kill(gw.supervisor.get("epp").pid)
    # Routed already, the stream no longer depends on the EPP: it runs to its end.
    responses = list(stream)
    assert responses[-1].complete.finish_reason == "length"
    assert sum(len(r.chunk.token_ids) for r in responses if r.HasField("chunk")) == 900 - 1
    # New requests fail closed, with the status an unreachable EPP maps to.
    with pytest.raises(grpc.RpcError) as info:
        generate(gw.stub, prompt(4), max_tokens=4)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def dead_pool_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A pool whose every replica is down (nothing listens on its ports)."""
    dead = (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    with running_gateway(tmp_path_factory.mktemp("dead"), replicas=0,
                         extra_endpoints=dead) as gw:
        yield gw


def test_no_ready_endpoint_is_unavailable_with_a_reason(dead_pool_gateway: Gateway) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(dead_pool_gateway.stub, prompt(1))
    error = info.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    metadata = dict(error.initial_metadata() or ()) | dict(error.trailing_metadata() or ())
    assert metadata.get(DROPPED_REASON)


SHEDDABLE = "batch-sheddable"


@pytest.fixture(scope="module")
def saturating_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One tiny engine (4 running sequences at most) that counts as saturated as soon as one
    request waits, and an objective with negative priority."""
    config = {**DEFAULT_EPP_CONFIG,
              "saturationDetector": {"queueDepthThreshold": 1, "metricsStalenessThreshold": "2s"}}
    objective = {"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                 "kind": "InferenceObjective", "metadata": {"name": SHEDDABLE},
                 "spec": {"priority": -1}}
    with running_gateway(tmp_path_factory.mktemp("shed"), replicas=1, profile="tiny",
                         time_scale=1.0, mode="echo", grace_period=1.0,
                         epp_config=[config, objective]) as gw:
        yield gw


def test_sheddable_request_is_shed_under_saturation(saturating_gateway: Gateway) -> None:
    gw = saturating_gateway
    # Eight ~0.9 s streams on an engine that runs four at a time: four wait.
    streams = [gw.stub.Generate(generate_request(prompt(seed), max_tokens=900, stream=True),
                                timeout=CALL_TIMEOUT) for seed in range(8)]
    for stream in streams[:4]:
        next(stream)  # running
    shed = None
    for attempt in range(40):  # bounded: until the EPP's view shows the queue
        try:
            generate(gw.stub, prompt(100 + attempt), max_tokens=1,
                     metadata=[(OBJECTIVE, SHEDDABLE)])
        except grpc.RpcError as exc:
            shed = exc
            break
        threading.Event().wait(0.02)
    for stream in streams:
        stream.cancel()
    assert shed is not None, "the sheddable request was never shed"
    # HTTP 429 from the EPP, as gRPC RESOURCE_EXHAUSTED, with the reason.
    assert shed.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    metadata = dict(shed.initial_metadata() or ()) | dict(shed.trailing_metadata() or ())
    assert "shed" in metadata.get(DROPPED_REASON, "")
    # A request with the default (non-sheddable) priority is still served.
    assert generate(gw.stub, prompt(999), max_tokens=1).completion_tokens == 1
