"""Hostile requests through the whole gateway (`kvswitch up`: Envoy, EPP, frontend, engine):
each gets its clear status, as from the standalone parts — a body over the frontend's limit
413 (not a reset turned 503), an undecodable transfer coding 501, absurd sampling counts and
truncated gRPC frames INVALID_ARGUMENT."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from kvswitch.launcher import frontend_available
from kvswitch.protocol import GENERATE_PATH, vllm_engine_pb2_grpc
from kvswitch.protocol import vllm_engine_pb2 as pb
from tests.support import raw_grpc
from tests.support.processes import free_port
from tests.support.up import kvswitch_up

pytestmark = pytest.mark.skipif(not frontend_available(), reason="needs the frontend")


@dataclass(frozen=True)
class Up:
    port: int
    state: Path
    """`kvswitch up`'s state directory (its pool file names the engine)."""


def engine_active_requests(up: Up) -> int:
    pool = [d for d in yaml.safe_load_all((up.state / "pool.yaml").read_text()) if d]
    [endpoint] = next(d["endpoints"] for d in pool if d.get("kind") == "EndpointList")
    with grpc.insecure_channel(endpoint) as channel:
        info = vllm_engine_pb2_grpc.VllmEngineStub(channel).GetServerInfo(
            pb.GetServerInfoRequest(), timeout=5)
    return int(info.active_requests)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("hostile")
    port = free_port()
    args = ["--port", str(port), "--replicas", "1", "--profile", "tiny", "--time-scale", "1",
            "--mode", "echo", "--grace-period", "1"]
    with kvswitch_up(args, tmp) as up:
        assert "is up on" in up.output(), up.output()
        yield Up(port, tmp / "state")


def test_a_body_over_the_limit_is_413(gateway: Up) -> None:
    body = b'{"model": "m", "prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    for _ in range(3):  # the refusal survives the body still being sent, every time
        reply = httpx.post(f"http://127.0.0.1:{gateway.port}/v1/completions", content=body,
                           headers={"content-type": "application/json"}, timeout=60)
        assert reply.status_code == 413, reply.text
        assert reply.json()["error"]["code"] == 413


def test_gzip_chunked_transfer_coding_is_not_read_as_plain(gateway: Up) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
                     b"5\r\nhello\r\n0\r\n\r\n")
        assert sock.recv(64).split()[1] == b"501"


def test_absurd_sampling_counts_are_invalid_argument(gateway: Up) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        for sampling in (pb.SamplingParams(n=10**6), pb.SamplingParams(stop=["x"] * 10000),
                         pb.SamplingParams(max_tokens=2**31)):
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(pb.GenerateRequest(text="hi", sampling_params=sampling),
                                   timeout=20))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "limit" in caught.value.details()


async def test_a_truncated_grpc_frame_is_invalid_argument(gateway: Up) -> None:
    message = pb.GenerateRequest(text="hi").SerializeToString()
    status, _ = await raw_grpc.call(
        gateway.port, GENERATE_PATH, raw_grpc.grpc_frame(message, declared=len(message) + 10))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_a_grpc_deadline_ends_the_call_through_the_gateway(gateway: Up) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        request = pb.GenerateRequest(text="hi", stream=True, sampling_params=pb.SamplingParams(
            max_tokens=1000, ignore_eos=True))
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=0.5))  # 1000 tokens take seconds at scale 1
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 3.0
    # The deadline reached the engine as an abort: the request is gone there too.
    deadline = time.monotonic() + 5
    while engine_active_requests(gateway):  # bounded by the deadline
        assert time.monotonic() < deadline, "the engine kept the expired request"
        time.sleep(0.05)


def test_the_gateway_still_serves_after_all_that(gateway: Up) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        messages = list(stub.Generate(pb.GenerateRequest(
            text="hi", sampling_params=pb.SamplingParams(max_tokens=2)), timeout=20))
    assert messages[-1].complete.completion_tokens == 2


