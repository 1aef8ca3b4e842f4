"""The h2 transport on loopback: grpc.aio clients and raw sockets against `EppServer`."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hpack import Encoder

from kvswitch.epp.contracts import EndpointPicker, InferenceRequest, RoutingDecision
from kvswitch.epp.parsers import default_parsers
from kvswitch.epp.parsers.passthrough import PassthroughParser
from kvswitch.epp.server import PROCESS_PATH, EppServer
from kvswitch.launcher import write_pool_file
from kvswitch.protocol.http2 import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    frame,
)
from tests.support.extproc import GENERATE, body, grpc_headers, http_headers, response_trailers
from tests.support.processes import free_port, kvswitch_argv, running
from tests.support.router import FakeRouter
from tests.support.waiting import until


class GatedRouter(FakeRouter):
    """Routes only once `gate` is set: the request waits in a task, as in flow control."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.task: asyncio.Task[object] | None = None
        """The task a cancelled route ran in (the server's)."""

    async def route(self, request: InferenceRequest,
                    subset: Sequence[str] | None) -> RoutingDecision:
        self.entered.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.task = asyncio.current_task()
            self.cancelled.set()
            raise
        return await super().route(request, subset)


async def start(router: FakeRouter, **picker: int) -> EppServer:
    parsers = [*default_parsers(), PassthroughParser()]
    server = EppServer(EndpointPicker(parsers=parsers, router=router, **picker), port=0)
    await server.start()
    return server


@pytest.fixture
async def router() -> FakeRouter:
    return FakeRouter()


@pytest.fixture
async def server(router: FakeRouter) -> AsyncIterator[EppServer]:
    srv = await start(router, max_body_bytes=8 << 20)
    yield srv
    await srv.stop(grace=0.1)


async def test_unknown_method_is_unimplemented(server: EppServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_unary("/nope.Service/Method")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(b"")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_large_body_is_echoed_through_flow_control(router: FakeRouter,
                                                          server: EppServer) -> None:
    payload = bytes(range(256)) * (3 * 4096 + 7)  # ≈ 3 MiB in ext_proc chunks of 256 KiB
    chunks = [payload[i:i + (256 << 10)] for i in range(0, len(payload), 256 << 10)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        await call.write(http_headers("/upload", ("content-type", "application/octet-stream")))
        for i, chunk in enumerate(chunks):
            await call.write(body(chunk, eos=i == len(chunks) - 1))
        reply = await call.read()
        assert reply.request_headers.response.header_mutation.set_headers
        echoed = b""
        while len(echoed) < len(payload):
            part = await call.read()
            echoed += part.request_body.response.body_mutation.streamed_response.body
        assert echoed == payload
        await call.write(response_trailers(("grpc-status", "0")))
        await call.read()
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
    assert len(router.finished) == 1


async def test_health_check_and_unknown_service(server: EppServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_messages_wait_behind_a_pending_route_and_finish_once() -> None:
    router = GatedRouter()
    server = await start(router)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process()
            await call.write(grpc_headers(("x-request-id", "gated")))
            await call.write(body(GENERATE, eos=True))
            await call.done_writing()  # the end of input arrives while routing waits
            await asyncio.sleep(0.05)
            router.gate.set()
            replies = [await call.read(), await call.read()]
            assert replies[0].HasField("request_headers")
            assert replies[1].request_body.response.body_mutation.streamed_response.body == GENERATE
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
        [(request, outcome)] = router.finished
        assert request.request_id == "gated" and not outcome.ok
    finally:
        await server.stop(grace=0.1)


async def test_reset_while_routing_releases_a_late_decision() -> None:
    router = GatedRouter()
    server = await start(router)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process()
            await call.write(grpc_headers())
            await call.write(body(GENERATE, eos=True))
            await asyncio.wait_for(router.entered.wait(), 5)
            call.cancel()
            await asyncio.wait_for(router.cancelled.wait(), 5)  # the server cancels the route
            assert router.task is not None
            # Its done callbacks, the server's first, have run once `wait` returns.
            await asyncio.wait({router.task}, timeout=5)
        assert router.routed == [] and router.finished == []  # cancelled before deciding
    finally:
        await server.stop(grace=0.1)


def _raw_request() -> bytes:
    headers = Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", PROCESS_PATH),
                                (":authority", "epp"), ("content-type", "application/grpc")])
    messages = b"".join(b"\x00" + struct.pack(">I", len(m)) + m for m in (
        grpc_headers().SerializeToString(), body(GENERATE, eos=True).SerializeToString()))
    return (PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, headers)
            + frame(DATA, 0, 1, messages))


async def test_connection_drop_finishes_the_routed_request_once(router: FakeRouter,
                                                                server: EppServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(_raw_request())
    got = b""
    while b"x-gateway-destination-endpoint" not in got:  # routed: the destination reply came
        got += await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    await asyncio.wait_for(router.finished_event.wait(), 5)
    await asyncio.sleep(0.05)
    [(_, outcome)] = router.finished
    assert not outcome.ok


async def test_garbage_gets_goaway_and_the_server_keeps_serving(server: EppServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 2, b"\x82"))
    data = b""
    while True:
        chunk = await asyncio.wait_for(reader.read(65536), 5)
        if not chunk:
            break
        data += chunk
    assert b"\x07\x00\x00\x00\x00\x00" in data  # a GOAWAY frame, then the connection closed
    writer.close()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_graceful_stop_lets_an_open_stream_finish(router: FakeRouter) -> None:
    server = await start(router)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        await call.write(grpc_headers())
        await call.write(body(GENERATE, eos=True))
        await call.read()
        await call.read()
        stopping = asyncio.create_task(server.stop(grace=10))
        await until(lambda: server.health_status("readiness")
                    == health_pb2.HealthCheckResponse.NOT_SERVING)
        assert not stopping.done()  # waiting for the open stream (the reply below comes)
        await call.write(response_trailers(("grpc-status", "0")))
        assert (await call.read()).HasField("response_trailers")
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        await asyncio.wait_for(stopping, 5)
    [(_, outcome)] = router.finished
    assert outcome.ok and router.stopped


async def read_frames(reader: asyncio.StreamReader,
                      until: Callable[[list[tuple[int, int, int, bytes]]], bool]
                      ) -> list[tuple[int, int, int, bytes]]:
    """Frames as (type, flags, stream, payload) until `until(frames)` holds."""
    frames: list[tuple[int, int, int, bytes]] = []
    while not until(frames):
        header = await asyncio.wait_for(reader.readexactly(9), 5)
        length = int.from_bytes(header[:3], "big")
        payload = await asyncio.wait_for(reader.readexactly(length), 5)
        frames.append((header[3], header[4], struct.unpack(">I", header[5:])[0], payload))
    return frames


@contextlib.asynccontextmanager
async def raw_client(server: EppServer) -> AsyncIterator[tuple[asyncio.StreamReader,
                                                               asyncio.StreamWriter]]:
    """A connected HTTP/2 client past the preface and the server's SETTINGS."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(PREFACE + frame(SETTINGS, 0, 0))
        await read_frames(reader, lambda f: any(k == SETTINGS and not fl for k, fl, _, _ in f))
        yield reader, writer
    finally:
        writer.close()


async def test_stop_serves_a_stream_sent_across_its_first_goaway(router: FakeRouter) -> None:
    """The race a single GOAWAY loses: a call the proxy sent before it read the GOAWAY. Here a
    raw client opens a health check only after the draining GOAWAY and PING arrived, and ACKs
    the PING after that: the call is answered, then the final GOAWAY names it."""
    server = await start(router)
    async with raw_client(server) as (reader, writer):
        stopping = asyncio.create_task(server.stop(grace=5))
        frames = await read_frames(reader, lambda f: any(k == PING for k, _, _, _ in f))
        [goaway] = [p for k, _, _, p in frames if k == GOAWAY]
        assert struct.unpack(">I", goaway[:4])[0] == 0x7FFFFFFF
        [opaque] = [p for k, _, _, p in frames if k == PING]
        block = Encoder().encode([(":method", "POST"), (":scheme", "http"),
                                  (":path", "/grpc.health.v1.Health/Check"),
                                  (":authority", "epp"), ("content-type", "application/grpc")])
        request = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
        writer.write(frame(HEADERS, END_HEADERS, 1, block)
                     + frame(DATA, END_STREAM, 1,
                             b"\x00" + struct.pack(">I", len(request)) + request))
        frames = await read_frames(
            reader, lambda f: any(k == HEADERS and fl & END_STREAM for k, fl, _, _ in f))
        assert not any(k == RST_STREAM for k, _, _, _ in frames)
        [reply] = [p for k, _, s, p in frames if k == DATA and s == 1]
        # Answered, not refused; and truthfully: a stopping EPP is no longer live.
        assert health_pb2.HealthCheckResponse.FromString(reply[5:]).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        assert not stopping.done()  # the final GOAWAY waits for the ACK
        writer.write(frame(PING, ACK, 0, opaque))
        frames = await read_frames(reader, lambda f: any(k == GOAWAY for k, _, _, _ in f))
        [final] = [p for k, _, _, p in frames if k == GOAWAY]
        assert struct.unpack(">I", final[:4])[0] == 1
        await asyncio.wait_for(stopping, 5)


async def test_stop_does_not_wait_for_a_ping_ack_that_never_comes(router: FakeRouter) -> None:
    server = await start(router)
    async with raw_client(server) as (reader, _):
        stopping = asyncio.create_task(server.stop(grace=30))
        frames = await read_frames(reader, lambda f: sum(k == GOAWAY for k, _, _, _ in f) == 2)
        assert struct.unpack(">I", [p for k, _, _, p in frames if k == GOAWAY][1][:4])[0] == 0
        await asyncio.wait_for(stopping, 5)  # the 1 s fallback, not the 30 s grace


async def test_graceful_stop_gives_up_after_grace(router: FakeRouter) -> None:
    server = await start(router)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        await call.write(grpc_headers())
        await call.write(body(GENERATE, eos=True))
        await call.read()
        await asyncio.wait_for(server.stop(grace=0.2), 5)
        assert len(router.finished) == 1  # the dropped stream still reported its end
        with pytest.raises(grpc.aio.AioRpcError):
            for _ in range(3):
                await call.read()
            await call.write(ep.ProcessingRequest())


def test_kvswitch_epp_process_serves_h2_by_default_and_stops_on_sigterm(tmp_path: Path) -> None:
    """The real `kvswitch epp` process: Health and Process on the default transport, with a
    pool whose only replica is down (503 with a reason), then SIGTERM ends it cleanly."""
    pool = write_pool_file(tmp_path / "pool.yaml", [f"127.0.0.1:{free_port()}"])
    port = free_port()
    argv = kvswitch_argv("epp", "--pool", str(pool), "--port", str(port), "--metrics-port", "0",
                         "--grace", "1")

    async def talk() -> ep.ProcessingResponse:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service="liveness"))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            call = ep_grpc.ExternalProcessorStub(channel).Process()
            await call.write(grpc_headers())
            await call.write(body(GENERATE, eos=True))
            answer: ep.ProcessingResponse = await call.read()
            await call.done_writing()
            return answer

    with running(argv, port, tmp_path / "epp.log") as process:
        answer = asyncio.run(talk())
        assert answer.immediate_response.grpc_status.status == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "(h2)" in process.output()
        assert process.stop(timeout=10) == 0


async def test_a_failing_handler_costs_its_stream_only(router: FakeRouter) -> None:
    server = await start(router)
    assert server._h2 is not None

    class Broken:
        def __init__(self, call: object) -> None:
            raise RuntimeError("handler bug")

    server._h2.handlers["/broken.Service/Call"] = Broken  # type: ignore[assignment]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary("/broken.Service/Call")(b"")
            assert info.value.code() == grpc.StatusCode.INTERNAL
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(grace=0.1)
