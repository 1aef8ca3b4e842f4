"""The HTTP/2 gRPC client against `h2` (python-hyper's reference implementation) as the server:
padded DATA, a long trailer block, server PINGs and SETTINGS, flow control over many messages,
an error status and a stream reset all read as a gRPC client must read them."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Callable

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from kvswitch.protocol import GENERATE_PATH, h2client
from kvswitch.protocol import vllm_engine_pb2 as pb

Responder = Callable[[h2.connection.H2Connection, int], None]


def grpc_message(message: pb.GenerateResponse) -> bytes:
    body = message.SerializeToString()
    return b"\x00" + struct.pack(">I", len(body)) + body


def chunk(i: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[i], index=0))


async def serve_h2(respond: Responder) -> tuple[asyncio.AbstractServer, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        conn.ping(b"pingpong")
        writer.write(conn.data_to_send())
        while data := await reader.read(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length,
                                                   event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    respond(conn, event.stream_id)
            writer.write(conn.data_to_send())
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.fixture
async def start() -> AsyncIterator[Callable[[Responder], object]]:
    servers: list[asyncio.AbstractServer] = []
    channels: list[h2client.H2Channel] = []

    async def run(respond: Responder) -> h2client.H2Channel:
        server, port = await serve_h2(respond)
        servers.append(server)
        channel = h2client.H2Channel([("127.0.0.1", port)])
        channels.append(channel)
        return channel

    yield run  # type: ignore[misc]
    for channel in channels:
        channel.close()
    for server in servers:
        server.close()


def ok_headers(conn: h2.connection.H2Connection, stream_id: int) -> None:
    conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])


async def test_padded_messages_and_long_trailers(start) -> None:  # type: ignore[no-untyped-def]
    long_message = "x" * 40_000  # over the 16 KiB default frame: h2 sizes it to our SETTINGS

    def respond(conn: h2.connection.H2Connection, stream_id: int) -> None:
        ok_headers(conn, stream_id)
        for i in range(3):
            conn.send_data(stream_id, grpc_message(chunk(i)), pad_length=7)
        conn.send_headers(stream_id, [("grpc-status", "0"), ("x-long", long_message)],
                          end_stream=True)

    channel = await start(respond)
    call = await channel.start(GENERATE_PATH, (), b"", pb.GenerateResponse.FromString)
    got: list[pb.GenerateResponse] = []
    while batch := await call.read_batch():
        got.extend(batch)
    assert [m.chunk.token_ids[0] for m in got] == [0, 1, 2]


async def test_many_messages_under_flow_control(start) -> None:  # type: ignore[no-untyped-def]
    def respond(conn: h2.connection.H2Connection, stream_id: int) -> None:
        ok_headers(conn, stream_id)
        for i in range(2000):  # ~30 KB of frames: h2 holds to our windows
            conn.send_data(stream_id, grpc_message(chunk(i)))
        conn.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)

    channel = await start(respond)
    call = await channel.start(GENERATE_PATH, (), b"", pb.GenerateResponse.FromString)
    got: list[pb.GenerateResponse] = []
    while batch := await asyncio.wait_for(call.read_batch(), 10):
        got.extend(batch)
    assert [m.chunk.token_ids[0] for m in got] == list(range(2000))


async def test_an_error_status_and_a_reset(start) -> None:  # type: ignore[no-untyped-def]
    calls = iter(range(2))

    def respond(conn: h2.connection.H2Connection, stream_id: int) -> None:
        if next(calls) == 0:
            conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc"),
                                          ("grpc-status", "3"), ("grpc-message", "bad%20input")],
                              end_stream=True)
        else:
            conn.reset_stream(stream_id, error_code=7)  # REFUSED_STREAM

    channel = await start(respond)
    with pytest.raises(h2client.StreamError) as caught:
        await channel.unary(GENERATE_PATH, b"", pb.GenerateResponse.FromString, timeout=5)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details == "bad input"
    with pytest.raises(h2client.StreamError) as caught:
        await channel.unary(GENERATE_PATH, b"", pb.GenerateResponse.FromString, timeout=5)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
