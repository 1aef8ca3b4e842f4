"""The lean HTTP/2 Generate client against a real grpc.aio server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol import vllm_engine_pb2_grpc as rpc
from kvswitch.protocol.h2client import H2Channel, StreamError, parse_target

PATH = "/vllm.grpc.engine.VllmEngine/Generate"


class _Engine(rpc.VllmEngineServicer):
    """Generate: `max_tokens` one-token chunks; request ids starting with "fail" end in an error
    after one chunk; "slow" ones wait forever between chunks (to be cancelled)."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []
        self.cancelled = asyncio.Event()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})
        try:
            for i in range(request.sampling_params.max_tokens):
                yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[i]))
                if request.request_id.startswith("fail"):
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue fülle 满")
                if request.request_id.startswith("slow"):
                    await asyncio.sleep(3600)
            yield pb.GenerateResponse(complete=pb.GenerateComplete(finish_reason="length"))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture()
async def served() -> AsyncIterator[tuple[_Engine, H2Channel]]:
    engine = _Engine()
    server = grpc.aio.server()
    rpc.add_VllmEngineServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = H2Channel([("127.0.0.1", port)])
    try:
        yield engine, channel
    finally:
        channel.close()
        await server.stop(0)


def _request(request_id: str, tokens: int) -> bytes:
    return pb.GenerateRequest(request_id=request_id, stream=True, sampling_params=pb.
                              SamplingParams(max_tokens=tokens)).SerializeToString()


async def _read_all(call: object) -> list[pb.GenerateResponse]:
    out: list[pb.GenerateResponse] = []
    while batch := await call.read_batch():  # type: ignore[attr-defined]
        out.extend(batch)
    return out


async def test_streams_every_message_in_order_with_metadata(
        served: tuple[_Engine, H2Channel]) -> None:
    engine, channel = served
    metadata = [("x-llm-d-inference-fairness-id", "tenant-a"), ("x-request-id", "r-1")]
    calls = [await channel.start(PATH, metadata, _request(f"ok-{i}", 200),
                                 pb.GenerateResponse.FromString) for i in range(3)]
    results = await asyncio.gather(*(_read_all(c) for c in calls))
    for messages in results:
        assert [m.chunk.token_ids[0] for m in messages[:-1]] == list(range(200))
        assert messages[-1].complete.finish_reason == "length"
    assert all(m["x-llm-d-inference-fairness-id"] == "tenant-a" for m in engine.metadata)
    assert len(engine.metadata) == 3


async def test_an_error_status_keeps_its_code_and_details(
        served: tuple[_Engine, H2Channel]) -> None:
    _, channel = served
    call = await channel.start(PATH, (), _request("fail-1", 5), pb.GenerateResponse.FromString)
    with pytest.raises(StreamError) as info:
        await _read_all(call)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details == "queue fülle 满"
    # The connection still serves the next call.
    assert len(await _read_all(await channel.start(PATH, (), _request("ok", 2),
                                                   pb.GenerateResponse.FromString))) == 3


async def test_cancel_reaches_the_server(served: tuple[_Engine, H2Channel]) -> None:
    engine, channel = served
    call = await channel.start(PATH, (), _request("slow-1", 5), pb.GenerateResponse.FromString)
    assert len(await call.read_batch()) == 1
    call.cancel()
    await asyncio.wait_for(engine.cancelled.wait(), 10)
    with pytest.raises(StreamError) as info:
        await call.read_batch()
    assert info.value.code == grpc.StatusCode.CANCELLED


def test_parse_target() -> None:
    assert parse_target("127.0.0.1:5000") == [("127.0.0.1", 5000)]
    assert parse_target("ipv4:127.0.0.1:1,127.0.0.1:2") == [("127.0.0.1", 1), ("127.0.0.1", 2)]
    assert parse_target("[::1]:7") == [("::1", 7)]
    assert parse_target("localhost:80") == [("localhost", 80)]
    for other in ("unix:/tmp/sock", "dns:///svc:80", "a:1,b:2", "nohost"):
        assert parse_target(other) is None
