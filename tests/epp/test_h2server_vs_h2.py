"""The EPP's HTTP/2 gRPC server against `h2` (python-hyper's reference implementation) as the
client: padded DATA, PRIORITY frames, client PINGs, a message split across DATA frames, many
calls on one connection, and a client reset, all served as a gRPC server must serve them."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator

import h2.config
import h2.connection
import h2.events
import pytest

from kvswitch.epp.h2server import Call, H2GrpcServer

PATH = "/test.Echo/Echo"


class Echo:
    """Sends every message back, then OK when the client half-closes."""

    def __init__(self, call: Call) -> None:
        self.call = call

    def on_message(self, message: bytes) -> None:
        self.call.send(message)

    def on_end(self) -> None:
        self.call.finish()

    def on_reset(self) -> None:
        pass


def framed(message: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(message)) + message


@pytest.fixture
async def port() -> AsyncIterator[int]:
    server = H2GrpcServer({PATH: Echo})
    yield await server.start()
    await server.stop(0)


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.flush()

    def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())

    def open(self) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, [
            (":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "epp"),
            ("content-type", "application/grpc"), ("te", "trailers")])
        return stream_id

    async def until_ended(self, streams: set[int]) -> dict[int, tuple[bytes, dict[str, str]]]:
        """Each stream's data and trailers, once every one of `streams` has ended."""
        data: dict[int, bytearray] = {s: bytearray() for s in streams}
        trailers: dict[int, dict[str, str]] = {}
        pinged = False
        while len(trailers) < len(streams):
            chunk = await asyncio.wait_for(self.reader.read(65536), 5)
            assert chunk, "the server closed the connection"
            for event in self.conn.receive_data(chunk):
                if isinstance(event, h2.events.DataReceived):
                    data[event.stream_id] += event.data
                    self.conn.acknowledge_received_data(event.flow_controlled_length,
                                                        event.stream_id)
                elif isinstance(event, h2.events.TrailersReceived):
                    trailers[event.stream_id] = dict(event.headers)  # type: ignore[arg-type]
                elif isinstance(event, h2.events.PingAckReceived):
                    pinged = True
            self.flush()
        assert pinged
        return {s: (bytes(data[s]), trailers[s]) for s in streams}


async def test_padding_priority_pings_and_split_messages(port: int) -> None:
    client = Client(*await asyncio.open_connection("127.0.0.1", port))
    client.conn.ping(b"12345678")
    streams = set()
    for i in range(20):
        stream_id = client.open()
        streams.add(stream_id)
        client.conn.prioritize(stream_id, weight=1 + i)
        message = framed(b"m%d" % i * 100)
        client.conn.send_data(stream_id, message[:7], pad_length=5)  # a message in two frames
        client.conn.send_data(stream_id, message[7:], end_stream=True, pad_length=3)
    client.flush()
    replies = await client.until_ended(streams)
    for i, stream_id in enumerate(sorted(streams)):
        body, trailers = replies[stream_id]
        assert body == framed(b"m%d" % i * 100) and trailers["grpc-status"] == "0"
    client.writer.close()


async def test_a_client_reset_leaves_the_other_calls_alone(port: int) -> None:
    client = Client(*await asyncio.open_connection("127.0.0.1", port))
    client.conn.ping(b"abcdefgh")
    gone = client.open()
    kept = client.open()
    client.conn.reset_stream(gone, error_code=8)
    client.conn.send_data(kept, framed(b"still here"), end_stream=True)
    client.flush()
    replies = await client.until_ended({kept})
    body, trailers = replies[kept]
    assert body == framed(b"still here") and trailers["grpc-status"] == "0"
    client.writer.close()
