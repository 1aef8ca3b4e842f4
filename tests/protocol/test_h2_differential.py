"""kvswitch's HTTP/2 core against the `h2` library as the peer, over an in-memory pipe: the EPP
server's core (`H2GrpcConnection`) with an h2 client, the gRPC client (`h2client`) with an h2
server. h2 checks every frame it reads by RFC 9113 (its own state machine raises on a broken
one), so each exchange is also a check of what kvswitch writes; and h2 writes what kvswitch
rarely sees from Envoy or grpcio: Huffman-coded, indexed headers, padding, small windows."""

from __future__ import annotations

import asyncio
import struct

import h2.config
import h2.connection
import h2.events
import pytest

from kvswitch.epp.h2connection import (
    ConnectionEnded,
    H2GrpcConnection,
    InputEnded,
    MessageReceived,
    StreamOpened,
)
from kvswitch.protocol import h2client
from kvswitch.protocol.h2client import StreamError
from kvswitch.protocol.http2 import ENHANCE_YOUR_CALM, MAX_FRAME, MAX_IDLE_FRAMES
from tests.fuzz.base import FakeTransport

PATH = "/x.Y/Z"
REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "epp"),
           ("content-type", "application/grpc"), ("te", "trailers")]


def grpc(message: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(message)) + message


# -- the server's core, an h2 client ---------------------------------------------------------


class ServerPipe:
    """An h2 client and `H2GrpcConnection` joined back to back; `pump()` moves bytes both ways
    until neither has anything to say, and keeps what each side saw."""

    def __init__(self, **options: int) -> None:
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.server = H2GrpcConnection(**options)
        self.client.initiate_connection()
        self.server.initiate()
        self.server_events: list[object] = []
        self.client_events: list[h2.events.Event] = []

    def pump(self) -> None:
        for _ in range(1000):
            upstream = self.client.data_to_send()
            if upstream:
                self.server_events += self.server.receive(upstream)
            downstream = self.server.data_to_send()
            if downstream:
                for event in self.client.receive_data(downstream):
                    self.client_events.append(event)
                    if isinstance(event, h2.events.DataReceived):  # a reader that keeps up
                        self.client.acknowledge_received_data(event.flow_controlled_length,
                                                              event.stream_id)
            if not upstream and not downstream:
                return
        raise AssertionError("the peers never went quiet")

    def of(self, kind: type) -> list:
        return [e for e in self.client_events if isinstance(e, kind)]


def test_a_bidi_call_with_an_h2_client() -> None:
    pipe = ServerPipe()
    pipe.client.send_headers(1, REQUEST)
    pipe.client.send_data(1, grpc(b"one") + grpc(b"two"))
    pipe.client.send_data(1, grpc(b"three"), pad_length=20, end_stream=True)
    pipe.pump()
    assert [type(e) for e in pipe.server_events] == [StreamOpened, MessageReceived,
                                                     MessageReceived, MessageReceived, InputEnded]
    assert [e.message for e in pipe.server_events if isinstance(e, MessageReceived)] == [
        b"one", b"two", b"three"]
    assert pipe.server.send_message(1, b"reply")
    pipe.server.finish(1)
    pipe.pump()
    [response] = pipe.of(h2.events.ResponseReceived)
    assert dict(response.headers)[b":status"] == b"200"
    assert b"".join(e.data for e in pipe.of(h2.events.DataReceived)) == grpc(b"reply")
    [trailers] = pipe.of(h2.events.TrailersReceived)
    assert dict(trailers.headers)[b"grpc-status"] == b"0"
    assert pipe.of(h2.events.StreamEnded)


def test_a_message_larger_than_the_windows_waits_for_window_updates() -> None:
    pipe = ServerPipe()
    pipe.client.send_headers(1, REQUEST, end_stream=True)
    pipe.pump()
    big = bytes(range(256)) * 1200  # 300 KiB: several times h2's 64 KiB windows
    assert pipe.server.send_message(1, big)
    pipe.server.finish(1)
    pipe.pump()
    assert b"".join(e.data for e in pipe.of(h2.events.DataReceived)) == grpc(big)
    assert max(len(e.data) for e in pipe.of(h2.events.DataReceived)) <= 16384  # h2's frame size
    assert pipe.of(h2.events.StreamEnded)


def test_long_trailers_go_out_as_continuation_frames() -> None:
    pipe = ServerPipe()
    pipe.client.send_headers(1, REQUEST, end_stream=True)
    pipe.pump()
    pipe.server.finish(1, 3, "x" * 40_000)  # trailers-only, over h2's 16 KiB frames
    pipe.pump()
    [response] = pipe.of(h2.events.ResponseReceived)
    assert dict(response.headers)[b"grpc-message"] == b"x" * 40_000
    assert pipe.of(h2.events.StreamEnded)


def test_the_client_pings_and_many_calls_share_the_hpack_table() -> None:
    pipe = ServerPipe()
    pipe.client.ping(b"h2-ping!")
    for stream_id in (1, 3, 5, 7):  # h2 indexes the headers: later blocks are all references
        pipe.client.send_headers(stream_id, REQUEST + [("x-call", str(stream_id))],
                                 end_stream=True)
    pipe.pump()
    assert [e.ping_data for e in pipe.of(h2.events.PingAckReceived)] == [b"h2-ping!"]
    opened = [e for e in pipe.server_events if isinstance(e, StreamOpened)]
    assert [(e.stream_id, e.path, e.headers["x-call"]) for e in opened] == [
        (1, PATH, "1"), (3, PATH, "3"), (5, PATH, "5"), (7, PATH, "7")]


def test_a_header_block_over_the_advertised_list_is_refused_with_goaway() -> None:
    pipe = ServerPipe()
    pipe.pump()
    assert pipe.client.remote_settings.max_header_list_size == 1 << 20
    # Many fields, not one long one: h2's Huffman coder is slow on long values.
    fields = [(f"x-{i}", "v" * 4096) for i in range(MAX_FRAME // 4096)]
    pipe.client.send_headers(1, REQUEST + fields)
    pipe.pump()
    assert pipe.server.closed
    assert [e.error_code for e in pipe.server_events if isinstance(e, ConnectionEnded)] == [
        ENHANCE_YOUR_CALM]
    [ended] = pipe.of(h2.events.ConnectionTerminated)
    assert ended.error_code == ENHANCE_YOUR_CALM


# -- the gRPC client, an h2 server -----------------------------------------------------------


class ClientPipe:
    """`h2client._Connection` on a fake transport and an h2 server; `pump()` as above. The
    server answers each request stream with `answer(stream_id, headers)`."""

    def __init__(self, read_size: int = 1 << 30) -> None:
        self.read_size = read_size  # bytes per data_received: how the socket would cut them
        self.server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.server.initiate_connection()
        self.transport = FakeTransport()
        self.conn = h2client._Connection("peer:1")
        self.conn.connection_made(self.transport)  # type: ignore[arg-type]
        self.server_events: list[h2.events.Event] = []
        self.requests: dict[int, list[tuple[bytes, bytes]]] = {}
        self.bodies: dict[int, bytes] = {}

    def pump(self) -> None:
        for _ in range(1000):
            self.conn._flush()  # what the loop would write next
            upstream = b"".join(self.transport.out)
            self.transport.out.clear()
            if upstream:
                for event in self.server.receive_data(upstream):
                    self.server_events.append(event)
                    if isinstance(event, h2.events.RequestReceived):
                        self.requests[event.stream_id] = event.headers
                    elif isinstance(event, h2.events.DataReceived):
                        self.bodies[event.stream_id] = (self.bodies.get(event.stream_id, b"")
                                                        + event.data)
                        self.server.acknowledge_received_data(event.flow_controlled_length,
                                                              event.stream_id)
            downstream = self.server.data_to_send()
            for start in range(0, len(downstream), self.read_size):
                self.conn.data_received(downstream[start:start + self.read_size])
            if not upstream and not downstream:
                return
        raise AssertionError("the peers never went quiet")

    def answer(self, stream_id: int, messages: list[bytes], status: str = "0",
               message: str = "", pad_length: int | None = None) -> None:
        self.server.send_headers(stream_id, [(":status", "200"),
                                             ("content-type", "application/grpc")])
        for body in messages:
            self.server.send_data(stream_id, grpc(body), pad_length=pad_length)
        trailers = [("grpc-status", status)] + ([("grpc-message", message)] if message else [])
        self.server.send_headers(stream_id, trailers, end_stream=True)


async def test_a_unary_call_to_an_h2_server() -> None:
    pipe = ClientPipe()
    call = pipe.conn.start(PATH, [("x-tenant", "a")], b"request", bytes, timeout=5)
    pipe.pump()
    headers = {k.decode(): v.decode() for k, v in pipe.requests[1]}
    assert headers[":path"] == PATH and headers["te"] == "trailers"
    assert headers["x-tenant"] == "a" and headers["grpc-timeout"] == "5000m"
    assert pipe.bodies[1] == grpc(b"request")
    pipe.answer(1, [b"response"])
    pipe.pump()
    assert await call.response() == b"response"


async def test_streamed_padded_responses_and_indexed_headers_over_many_calls() -> None:
    pipe = ClientPipe()
    for round_ in range(3):  # h2's encoder indexes: from the second call on, headers are refs
        stream_id = 2 * round_ + 1
        call = pipe.conn.start(PATH, (), b"", bytes)
        pipe.pump()
        pipe.answer(stream_id, [b"a" * 100, b"b" * 40_000, b""], pad_length=7)
        pipe.pump()
        messages = await call.read_batch()
        assert messages == [b"a" * 100, b"b" * 40_000, b""]
        assert await call.read_batch() == []


async def test_an_error_status_with_a_percent_encoded_message() -> None:
    pipe = ClientPipe()
    call = pipe.conn.start(PATH, (), b"", bytes)
    pipe.pump()
    pipe.answer(1, [], status="8", message="too much %25 ok")
    pipe.pump()
    with pytest.raises(StreamError) as caught:
        await call.response()
    assert caught.value.code.name == "RESOURCE_EXHAUSTED"
    assert caught.value.details == "too much % ok"


async def test_the_server_pings_and_goaway_fails_only_the_calls_it_did_not_take() -> None:
    pipe = ClientPipe()
    first = pipe.conn.start(PATH, (), b"", bytes)
    second = pipe.conn.start(PATH, (), b"", bytes)
    pipe.pump()
    pipe.server.ping(b"srv-ping")
    pipe.pump()
    pipe.server.close_connection(last_stream_id=1)
    pipe.pump()
    assert [e.ping_data for e in pipe.server_events
            if isinstance(e, h2.events.PingAckReceived)] == [b"srv-ping"]
    with pytest.raises(StreamError) as caught:
        await asyncio.wait_for(second.response(), 1)
    assert caught.value.code.name == "UNAVAILABLE"
    assert not first._ended  # stream 1 was taken: it may still finish


async def test_a_header_block_over_the_client_limit_ends_the_connection() -> None:
    pipe = ClientPipe()
    call = pipe.conn.start(PATH, (), b"", bytes)
    pipe.pump()
    fields = [(f"x-{i}", "v" * 2048) for i in range(h2client.MAX_HEADER_BLOCK // 2048)]
    pipe.server.send_headers(1, [(":status", "200"), *fields])
    pipe.pump()
    with pytest.raises(StreamError) as caught:
        await asyncio.wait_for(call.response(), 1)
    assert caught.value.code.name == "UNAVAILABLE"
    [ended] = [e for e in pipe.server_events if isinstance(e, h2.events.ConnectionTerminated)]
    assert ended.error_code == ENHANCE_YOUR_CALM


async def test_a_ping_flood_from_the_server_ends_the_connection() -> None:
    pipe = ClientPipe()
    call = pipe.conn.start(PATH, (), b"", bytes)
    pipe.pump()
    for i in range(MAX_IDLE_FRAMES + 1):
        pipe.server.ping(i.to_bytes(8, "big"))
    pipe.pump()
    with pytest.raises(StreamError) as caught:
        await asyncio.wait_for(call.response(), 1)
    assert caught.value.code.name == "UNAVAILABLE"
    [ended] = [e for e in pipe.server_events if isinstance(e, h2.events.ConnectionTerminated)]
    assert ended.error_code == ENHANCE_YOUR_CALM


async def test_a_big_message_over_many_small_reads_arrives_whole() -> None:
    pipe = ClientPipe(read_size=1000)
    call = pipe.conn.start(PATH, (), b"", bytes)
    pipe.pump()
    big = bytes(range(256)) * 1200
    pipe.answer(1, [big, b"after"])
    pipe.pump()
    assert await call.read_batch() == [big, b"after"]


async def test_a_response_message_over_the_limit_fails_its_call_before_it_is_kept() -> None:
    pipe = ClientPipe()
    call = pipe.conn.start(PATH, (), b"", bytes)
    pipe.pump()
    pipe.server.send_headers(1, [(":status", "200"), ("content-type", "application/grpc")])
    pipe.server.send_data(1, b"\x00" + struct.pack(">I", h2client.MAX_RESPONSE_MESSAGE + 1))
    pipe.pump()
    with pytest.raises(StreamError) as caught:
        await asyncio.wait_for(call.response(), 1)
    assert caught.value.code.name == "RESOURCE_EXHAUSTED"
    assert [e.stream_id for e in pipe.server_events if isinstance(e, h2.events.StreamReset)] == [1]
