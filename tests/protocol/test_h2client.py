"""The HTTP/2 gRPC client's unary calls, deadlines, failures and flow control, against a real
grpc.aio server on loopback (and, for exact frames, a fake transport)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

from kvswitch.protocol import common_pb2, h2client, h2client_core, method_path
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol import vllm_engine_pb2_grpc as rpc
from kvswitch.protocol.h2client import H2Channel, NotAccepted, StreamError, timeout_header
from kvswitch.protocol.http2 import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    U32,
    WINDOW_UPDATE,
    frame,
)

LOADS = method_path("GetLoads")
INFO = method_path("GetServerInfo")
EVENTS = method_path("SubscribeKvEvents")


class _Engine(rpc.VllmEngineServicer):
    """GetLoads answers at once (and records the deadline it was given); GetServerInfo never
    answers; SubscribeKvEvents streams `start_sequence_number` batches then ends, or streams
    one batch and waits forever when asked for 0."""

    def __init__(self) -> None:
        self.time_remaining: list[float | None] = []
        self.user_agents: list[str] = []
        self.cancelled = asyncio.Event()

    async def GetLoads(self, request, context):  # type: ignore[no-untyped-def]
        self.time_remaining.append(context.time_remaining())
        self.user_agents.append(dict(context.invocation_metadata())["user-agent"])
        return pb.GetLoadsResponse(dp_rank_count=1, loads=[pb.SchedulerLoad(num_running_reqs=3)])

    async def GetServerInfo(self, request, context):  # type: ignore[no-untyped-def]
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def SubscribeKvEvents(self, request, context):  # type: ignore[no-untyped-def]
        count = request.start_sequence_number
        for i in range(max(count, 1)):
            yield common_pb2.KvEventBatch(sequence_number=i)
        if not count:
            await asyncio.sleep(3600)


@pytest.fixture()
async def served() -> AsyncIterator[tuple[_Engine, int]]:
    engine = _Engine()
    server = grpc.aio.server()
    rpc.add_VllmEngineServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield engine, port
    finally:
        await server.stop(0)


def _events_request(count: int) -> bytes:
    return common_pb2.SubscribeKvEventsRequest(start_sequence_number=count).SerializeToString()


async def test_unary_returns_the_response_and_sends_the_deadline(
        served: tuple[_Engine, int]) -> None:
    engine, port = served
    channel = H2Channel.to(f"127.0.0.1:{port}", user_agent="kvswitch-epp")
    try:
        for _ in range(3):  # one connection, reused
            loads = await channel.unary(LOADS, b"", pb.GetLoadsResponse.FromString, timeout=5.0)
            assert loads.loads[0].num_running_reqs == 3
    finally:
        channel.close()
    remaining = engine.time_remaining[0]
    assert remaining is not None and 4.0 < remaining <= 5.0
    assert engine.user_agents[0].startswith("kvswitch-epp")


async def test_deadline_fails_the_call_and_resets_it(served: tuple[_Engine, int]) -> None:
    engine, port = served
    channel = H2Channel.to(f"127.0.0.1:{port}")
    try:
        started = time.monotonic()
        with pytest.raises(StreamError) as info:
            await channel.unary(INFO, b"", pb.GetServerInfoResponse.FromString, timeout=0.2)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 1.0
        await asyncio.wait_for(engine.cancelled.wait(), 5)
        # The connection still serves other calls.
        await channel.unary(LOADS, b"", pb.GetLoadsResponse.FromString, timeout=5.0)
    finally:
        channel.close()


async def test_a_stream_answering_two_messages_is_not_a_unary_response(
        served: tuple[_Engine, int]) -> None:
    _, port = served
    channel = H2Channel.to(f"127.0.0.1:{port}")
    try:
        with pytest.raises(StreamError) as info:
            await channel.unary(EVENTS, _events_request(2), common_pb2.KvEventBatch.FromString)
        assert info.value.code == grpc.StatusCode.INTERNAL
        call = await channel.start(EVENTS, (), _events_request(3),
                                   common_pb2.KvEventBatch.FromString)
        seen = []
        while batch := await call.read_batch():
            seen.extend(m.sequence_number for m in batch)
        assert seen == [0, 1, 2]
    finally:
        channel.close()


async def test_refused_connection_is_unavailable() -> None:
    from tests.support.processes import free_port

    channel = H2Channel.to(f"127.0.0.1:{free_port()}")
    with pytest.raises(StreamError) as info:
        await channel.unary(LOADS, b"", pb.GetLoadsResponse.FromString, timeout=1.0)
    assert isinstance(info.value, NotAccepted)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "cannot connect" in info.value.details


async def test_a_connect_its_caller_gave_up_on_leaves_no_unretrieved_error() -> None:
    from tests.support.processes import free_port

    reports: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reports.append(context))
    try:
        channel = H2Channel.to(f"127.0.0.1:{free_port()}")  # nothing listens: refused
        caller = asyncio.create_task(
            channel.unary(LOADS, b"", pb.GetLoadsResponse.FromString, timeout=1.0))
        await asyncio.sleep(0)  # the caller has started the connect ...
        caller.cancel()  # ... and is cancelled before it fails
        with pytest.raises(asyncio.CancelledError):
            await caller
        connecting = channel._connecting[0]  # the connect the cancelled caller left running
        assert connecting is not None
        await asyncio.wait({connecting}, timeout=5)  # refused: it has failed now
        assert connecting.done()
        channel.close()
        del channel, caller, connecting
        gc.collect()  # an unretrieved task error is reported when the task is collected
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert reports == []


async def test_closing_while_connecting_leaves_no_connection_open() -> None:
    accepted: list[asyncio.StreamReader] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(reader)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    channel = H2Channel.to(f"127.0.0.1:{port}")
    caller = asyncio.create_task(
        channel.unary(LOADS, b"", pb.GetLoadsResponse.FromString, timeout=5.0))
    try:
        await asyncio.sleep(0)  # the connect is under way
        channel.close()
        with pytest.raises((asyncio.CancelledError, StreamError)):
            await asyncio.wait_for(caller, 1.0)
        await asyncio.sleep(0.1)
        for reader in accepted:  # any connection that got through was closed again
            await asyncio.wait_for(reader.read(), 1.0)  # (times out if it stayed open)
            assert reader.at_eof()
    finally:
        server.close()
        await server.wait_closed()


async def test_lost_connection_fails_every_open_call_at_once_and_tells_the_owner() -> None:
    accepted: list[asyncio.StreamWriter] = []
    all_sent = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.readexactly(len(PREFACE))
        opened = 0
        while opened < 4:  # read frames, never answered, until all four calls have started
            header = await reader.readexactly(9)
            await reader.readexactly(int.from_bytes(header[:3], "big"))
            opened += header[3] == HEADERS
        all_sent.set()
        await reader.read()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    lost: list[float] = []
    channel = H2Channel.to(f"127.0.0.1:{port}", on_lost=lambda: lost.append(time.monotonic()))
    try:
        calls = [await channel.start(EVENTS, (), _events_request(0),
                                     common_pb2.KvEventBatch.FromString) for _ in range(3)]
        unary = asyncio.create_task(
            channel.unary(LOADS, b"", pb.GetLoadsResponse.FromString, timeout=30))
        await asyncio.wait_for(all_sent.wait(), 5)
        accepted[0].transport.abort()  # the engine died: its socket is reset
        dropped = time.monotonic()
        for call in calls:
            with pytest.raises(StreamError) as info:
                await asyncio.wait_for(call.read_batch(), 1.0)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(StreamError) as info:
            await asyncio.wait_for(unary, 1.0)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert len(lost) == 1 and lost[0] - dropped < 0.5
    finally:
        channel.close()
        server.close()
        await server.wait_closed()
    assert len(lost) == 1  # closing the channel on purpose is not a loss


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written += data

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def _frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, offset = [], 0
    while offset < len(data):
        length = U32.unpack_from(data, offset)[0] >> 8
        kind, flags = data[offset + 3], data[offset + 4]
        stream_id = U32.unpack_from(data, offset + 5)[0]
        out.append((kind, flags, stream_id, bytes(data[offset + 9:offset + 9 + length])))
        offset += 9 + length
    return out


def _grpc_message(payload: bytes) -> bytes:
    return b"\x00" + U32.pack(len(payload)) + payload


async def test_a_long_stream_gets_its_window_back_and_a_bad_message_fails_only_its_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hpack import Encoder

    monkeypatch.setattr(h2client_core, "REFILL_AT", 100)
    conn, transport = h2client._Connection("x"), _Transport()
    conn.connection_made(transport)
    good = conn.start(EVENTS, (), b"", common_pb2.KvEventBatch.FromString)
    bad = conn.start(EVENTS, (), b"", common_pb2.KvEventBatch.FromString)
    encoder = Encoder()
    conn.data_received(frame(SETTINGS, 0, 0)
                       + frame(HEADERS, END_HEADERS, 1, encoder.encode([(":status", "200")]))
                       + frame(HEADERS, END_HEADERS, 3, encoder.encode([(":status", "200")])))
    message = _grpc_message(common_pb2.KvEventBatch(sequence_number=7).SerializeToString())
    transport.written.clear()
    conn.data_received(b"".join(frame(DATA, 0, 1, message) for _ in range(40))
                       + frame(DATA, 0, 3, _grpc_message(b"\xff\xff\xff")))
    assert [m.sequence_number for m in await good.read_batch()] == [7] * 40
    updates = [(sid, U32.unpack(payload)[0]) for kind, _, sid, payload
               in _frames(bytes(transport.written)) if kind == WINDOW_UPDATE]
    # The stream that used its window gets it back (the connection too); the other not yet.
    assert dict(updates) == {1: 40 * len(message), 0: 40 * len(message) + 8}
    with pytest.raises(StreamError) as info:
        await bad.read_batch()
    assert info.value.code == grpc.StatusCode.INTERNAL
    conn._flush()
    assert any(kind == 3 and sid == 3 for kind, _, sid, _ in _frames(bytes(transport.written)))


def test_timeout_header() -> None:
    assert timeout_header(1.0) == "1000m"
    assert timeout_header(0.0001) == "1m"
    assert timeout_header(10**6) == "1000000S"



def _streaming(*handlers: h2client.MessageCallback
               ) -> tuple[h2client._Connection, _Transport, list[h2client.StreamCall]]:
    """A connection on a fake transport with one `on_message` call per handler, answered."""
    from hpack import Encoder

    conn, transport = h2client._Connection("x"), _Transport()
    conn.connection_made(transport)
    calls = [conn.start(EVENTS, (), b"", common_pb2.KvEventBatch.FromString, on_message=h)
             for h in handlers]
    encoder = Encoder()
    conn.data_received(frame(SETTINGS, 0, 0) + b"".join(
        frame(HEADERS, END_HEADERS, call._id, encoder.encode([(":status", "200")]))
        for call in calls))
    conn._flush()
    transport.written.clear()  # the preface and requests: `_resets` reads what comes next
    return conn, transport, calls


def _batches(stream_id: int, *numbers: int) -> bytes:
    return b"".join(frame(DATA, 0, stream_id, _grpc_message(
        common_pb2.KvEventBatch(sequence_number=n).SerializeToString())) for n in numbers)


def _recorder(seen: list[int]) -> h2client.MessageCallback:
    def on_message(message: common_pb2.KvEventBatch) -> bool:
        seen.append(message.sequence_number)
        return True
    return on_message


def _resets(transport: _Transport) -> list[int]:
    return [sid for kind, _, sid, _ in _frames(bytes(transport.written)) if kind == RST_STREAM]


async def test_on_message_gets_each_message_inside_data_received_and_ended_waits() -> None:
    from hpack import Encoder

    seen: list[int] = []
    conn, _, (call,) = _streaming(_recorder(seen))
    conn.data_received(_batches(1, 1, 2))
    assert seen == [1, 2]  # nothing to await: no task woken per read
    ending = asyncio.create_task(call.ended())
    await asyncio.sleep(0)
    assert not ending.done()
    trailers = Encoder().encode([(":status", "200"), ("grpc-status", "0")])
    conn.data_received(_batches(1, 3) + frame(HEADERS, END_HEADERS | END_STREAM, 1, trailers))
    await asyncio.wait_for(ending, 1.0)  # ended OK: returns
    assert seen == [1, 2, 3]
    assert await call.read_batch() == []


async def test_on_message_returning_false_cancels_only_its_call() -> None:
    stopped: list[int] = []
    other: list[int] = []

    def stop_at_2(message: common_pb2.KvEventBatch) -> bool:
        stopped.append(message.sequence_number)
        return message.sequence_number != 2

    conn, transport, (call, _) = _streaming(
        stop_at_2, _recorder(other))
    conn.data_received(_batches(1, 1, 2, 3) + _batches(3, 1, 2, 3))
    assert stopped == [1, 2] and other == [1, 2, 3]  # nothing after the stop is handed over
    with pytest.raises(StreamError) as info:
        await call.ended()
    assert info.value.code == grpc.StatusCode.CANCELLED
    conn.data_received(_batches(1, 4) + _batches(3, 4))  # in flight when we reset: dropped
    assert stopped == [1, 2] and other == [1, 2, 3, 4]
    conn._flush()
    assert _resets(transport) == [1]


async def test_a_failing_on_message_ends_its_call_with_that_error() -> None:
    def fail_at_2(message: common_pb2.KvEventBatch) -> bool:
        if message.sequence_number == 2:
            raise RuntimeError("handler bug")
        return True

    conn, transport, (call,) = _streaming(fail_at_2)
    conn.data_received(_batches(1, 1, 2, 3))
    with pytest.raises(RuntimeError, match="handler bug"):
        await call.ended()
    conn._flush()
    assert _resets(transport) == [1]


async def test_with_on_message_a_bad_message_fails_the_call_after_those_before_it() -> None:
    seen: list[int] = []
    conn, transport, (call,) = _streaming(_recorder(seen))
    conn.data_received(_batches(1, 1, 2) + frame(DATA, 0, 1, _grpc_message(b"\xff\xff\xff")))
    assert seen == [1, 2]
    with pytest.raises(StreamError) as info:
        await call.ended()
    assert info.value.code == grpc.StatusCode.INTERNAL
    conn._flush()
    assert _resets(transport) == [1]
