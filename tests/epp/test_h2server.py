"""The sans-IO HTTP/2 gRPC core: exact bytes in, exact events and frames out, no network."""

from __future__ import annotations

import asyncio
import random
import struct
from typing import Any

import pytest
from hpack import Decoder, Encoder

from kvswitch.epp.h2connection import (
    MAX_CONCURRENT_STREAMS,
    ConnectionEnded,
    H2GrpcConnection,
    InputEnded,
    MessageReceived,
    StreamOpened,
    StreamReset,
)
from kvswitch.epp.h2server import Call, H2GrpcServer
from kvswitch.protocol.http2 import (
    ACK,
    CANCEL,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INTERNAL_ERROR,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    frame,
)

PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def grpc(message: bytes, compressed: bool = False) -> bytes:
    return bytes((int(compressed),)) + struct.pack(">I", len(message)) + message


def settings(**values: int) -> bytes:
    ids = {"initial_window": 0x4, "max_frame": 0x5, "enable_push": 0x2, "table_size": 0x1}
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", ids[k], v) for k, v in values.items()))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment))


class Peer:
    """The client side: encodes what a gRPC client (Envoy) sends, decodes what comes back."""

    def __init__(self, stream_window: int = 4 << 20,
                 max_concurrent_streams: int = MAX_CONCURRENT_STREAMS,
                 **peer_settings: int) -> None:
        self.conn = H2GrpcConnection(max_message_bytes=1 << 16, stream_window=stream_window,
                                     max_concurrent_streams=max_concurrent_streams)
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.conn.initiate()
        self.events = self.conn.receive(PREFACE + settings(**peer_settings))
        self.frames = self.read()

    def headers_block(self, path: str = PATH, **extra: str) -> bytes:
        return bytes(self.encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", path),
            (":authority", "epp"), ("content-type", "application/grpc"), ("te", "trailers"),
            *extra.items()]))

    def open(self, stream_id: int, path: str = PATH, end: bool = False) -> list[Any]:
        flags = END_HEADERS | (END_STREAM if end else 0)
        return self.send(frame(HEADERS, flags, stream_id, self.headers_block(path)))

    def send(self, data: bytes) -> list[Any]:
        return list(self.conn.receive(data))

    def read(self) -> list[tuple[int, int, int, bytes]]:
        data, out, offset = self.conn.data_to_send(), [], 0
        while offset < len(data):
            length = struct.unpack(">I", b"\x00" + data[offset:offset + 3])[0]
            kind, flags = data[offset + 3], data[offset + 4]
            stream_id = struct.unpack(">I", data[offset + 5:offset + 9])[0]
            out.append((kind, flags, stream_id, data[offset + 9:offset + 9 + length]))
            offset += 9 + length
        return out

    def headers_of(self, payload: bytes) -> dict[str, str]:
        return {str(k): str(v) for k, v in self.decoder.decode(payload)}


def goaway_code(frames: list[tuple[int, int, int, bytes]]) -> int:
    [payload] = [p for kind, _, _, p in frames if kind == GOAWAY]
    return int(struct.unpack(">I", payload[4:8])[0])


def settings_of(payload: bytes) -> dict[int, int]:
    return dict(struct.unpack(">HI", payload[i:i + 6]) for i in range(0, len(payload), 6))


REFUSED = struct.pack(">I", REFUSED_STREAM)


# -- connection set-up ---------------------------------------------------------------------------


def test_preface_and_settings_are_answered() -> None:
    peer = Peer()
    kinds = [(kind, flags) for kind, flags, _, _ in peer.frames]
    assert kinds == [(SETTINGS, 0), (WINDOW_UPDATE, 0), (SETTINGS, ACK)]
    assert settings_of(peer.frames[0][3])[0x2] == 0
    assert peer.events == []


@pytest.mark.parametrize("limit", [MAX_CONCURRENT_STREAMS, 2])
def test_settings_advertise_the_concurrent_stream_limit(limit: int) -> None:
    peer = Peer(max_concurrent_streams=limit)
    assert settings_of(peer.frames[0][3])[0x3] == limit  # SETTINGS_MAX_CONCURRENT_STREAMS


def test_the_stream_limit_is_generous_by_default_and_positive() -> None:
    assert MAX_CONCURRENT_STREAMS >= 4096  # Envoy's EPP cluster multiplexes every request on it
    with pytest.raises(ValueError, match="max_concurrent_streams"):
        H2GrpcConnection(max_concurrent_streams=0)


def test_preface_may_arrive_a_byte_at_a_time() -> None:
    conn = H2GrpcConnection()
    for byte in PREFACE + settings():
        assert conn.receive(bytes((byte,))) == []
    assert not conn.closed


def test_ping_is_acked_with_its_payload() -> None:
    peer = Peer()
    peer.send(frame(PING, 0, 0, b"12345678"))
    assert peer.read() == [(PING, ACK, 0, b"12345678")]
    peer.send(frame(PING, ACK, 0, b"12345678"))
    assert peer.read() == []


# -- calls ---------------------------------------------------------------------------------------


def test_bidi_call_messages_in_order_then_trailers() -> None:
    peer = Peer()
    wire = frame(HEADERS, END_HEADERS, 1, peer.headers_block(**{"grpc-timeout": "1S"}))
    wire += frame(DATA, 0, 1, grpc(b"one") + grpc(b"two")[:4])
    wire += frame(DATA, 0, 1, grpc(b"two")[4:]) + frame(DATA, END_STREAM, 1, b"")
    events = []
    for i in range(0, len(wire), 7):  # arbitrary TCP segmentation
        events += peer.send(wire[i:i + 7])
    opened, one, two, ended = events
    assert isinstance(opened, StreamOpened) and opened.path == PATH
    assert opened.headers["grpc-timeout"] == "1S"  # ignored, but visible
    assert (one, two, ended) == (MessageReceived(1, b"one"), MessageReceived(1, b"two"),
                                 InputEnded(1))
    peer.conn.send_message(1, b"reply")
    peer.conn.finish(1)
    (h, hf, _, hp), (d, df, _, dp), (t, tf, _, tp) = peer.read()
    assert (h, hf, d, df, t, tf) == (HEADERS, END_HEADERS, DATA, 0, HEADERS,
                                     END_HEADERS | END_STREAM)
    assert peer.headers_of(hp) == {":status": "200", "content-type": "application/grpc"}
    assert dp == grpc(b"reply")
    assert peer.headers_of(tp) == {"grpc-status": "0"}
    assert peer.conn.streams == {}


def test_trailers_only_with_a_percent_encoded_message() -> None:
    peer = Peer()
    peer.open(1, end=True)
    peer.conn.finish(1, 5, "unknown service: 100%")
    [(kind, flags, _, payload)] = peer.read()
    assert (kind, flags) == (HEADERS, END_HEADERS | END_STREAM)
    assert peer.headers_of(payload) == {":status": "200", "content-type": "application/grpc",
                                        "grpc-status": "5",
                                        "grpc-message": "unknown service: 100%25"}


def test_finish_before_the_client_ends_resets_its_input() -> None:
    peer = Peer()
    peer.open(1)
    peer.conn.finish(1, 12, "nope")
    assert [(k, s) for k, _, s, _ in peer.read()] == [(HEADERS, 1), (RST_STREAM, 1)]
    assert peer.send(frame(DATA, END_STREAM, 1, grpc(b"late"))) == []  # discarded


def test_continuation_padding_and_priority() -> None:
    peer = Peer()
    block = peer.headers_block()
    first = bytes((3,)) + b"\x00\x00\x00\x00\x10" + block[:5] + b"pad"
    events = peer.send(frame(HEADERS, PADDED | PRIORITY_FLAG, 1, first)
                       + frame(CONTINUATION, 0, 1, block[5:9])
                       + frame(CONTINUATION, END_HEADERS, 1, block[9:])
                       + frame(DATA, PADDED | END_STREAM, 1, bytes((2,)) + grpc(b"x") + b"zz"))
    assert [type(e) for e in events] == [StreamOpened, MessageReceived, InputEnded]
    assert events[1] == MessageReceived(1, b"x")


def test_repeated_indexed_header_blocks_decode_the_same() -> None:
    peer = Peer()
    first = peer.open(1, end=True)[0]
    for stream_id in (3, 5):  # all-indexed blocks now: served from the cache
        again = peer.open(stream_id, end=True)[0]
        assert isinstance(again, StreamOpened) and again.headers == first.headers
    # A block that changes the dynamic table, then the old indexed block again.
    peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 7, peer.headers_block(**{"x-a": "1"})))
    fresh = peer.open(9, end=True)[0]
    assert fresh.headers == first.headers


def test_client_trailers_end_the_input() -> None:
    peer = Peer()
    peer.open(1)
    trailers = bytes(peer.encoder.encode([("x-end", "1")]))
    assert peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, trailers)) == [InputEnded(1)]


def test_a_stream_over_the_limit_is_refused_and_the_open_ones_carry_on() -> None:
    peer = Peer(max_concurrent_streams=2)
    assert isinstance(peer.open(1)[0], StreamOpened)
    assert isinstance(peer.open(3, end=True)[0], StreamOpened)  # half-closed: still counts
    # The third: refused (retryable), no event; its block (adding x-a to the HPACK table) is
    # still decoded, so later blocks naming x-a by index decode.
    refused = frame(HEADERS, END_HEADERS, 5, peer.headers_block(**{"x-a": "1"}))
    assert peer.send(refused) == []
    assert peer.read() == [(RST_STREAM, 0, 5, REFUSED)]
    assert peer.send(frame(DATA, END_STREAM, 5, grpc(b"sent before the reset"))) == []
    assert not peer.conn.closed and sorted(peer.conn.streams) == [1, 3]
    # The open streams work as before.
    assert peer.send(frame(DATA, 0, 1, grpc(b"one"))) == [MessageReceived(1, b"one")]
    assert peer.conn.send_message(3, b"three")
    assert [(k, s) for k, _, s, _ in peer.read()] == [(HEADERS, 3), (DATA, 3)]
    # One ends (server trailers on a half-closed stream): a new stream is taken.
    peer.conn.finish(3)
    assert [(k, s) for k, _, s, _ in peer.read()] == [(HEADERS, 3)]
    [opened] = peer.send(frame(HEADERS, END_HEADERS, 7, peer.headers_block(**{"x-a": "1"})))
    assert isinstance(opened, StreamOpened) and opened.headers["x-a"] == "1"
    # Full again (1 and 7); a client reset frees a slot too.
    assert peer.open(9) == [] and peer.read() == [(RST_STREAM, 0, 9, REFUSED)]
    assert peer.send(frame(RST_STREAM, 0, 1, struct.pack(">I", CANCEL))) == [StreamReset(1, CANCEL)]
    assert isinstance(peer.open(11)[0], StreamOpened)
    assert sorted(peer.conn.streams) == [7, 11] and not peer.conn.closed


async def test_the_server_gives_its_connections_the_stream_limit() -> None:
    class Echo:
        def __init__(self, call: Call) -> None:
            self.call = call

        def on_message(self, message: bytes) -> None:
            self.call.send(message)

        def on_end(self) -> None:
            self.call.finish()

        def on_reset(self) -> None:
            pass

    server = H2GrpcServer({PATH: Echo}, max_concurrent_streams=1)
    port = await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    encoder = Encoder()
    block = bytes(encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", PATH),
                                  (":authority", "epp"), ("content-type", "application/grpc")]))

    async def next_frame() -> tuple[int, int, bytes]:
        header = await asyncio.wait_for(reader.readexactly(9), 5)
        payload = await reader.readexactly(int.from_bytes(header[:3], "big"))
        return header[3], struct.unpack(">I", header[5:])[0], payload

    try:
        writer.write(PREFACE + settings() + frame(HEADERS, END_HEADERS, 1, block)
                     + frame(HEADERS, END_HEADERS, 3, block) + frame(DATA, 0, 1, grpc(b"hi")))
        kind, _, payload = await next_frame()
        assert kind == SETTINGS and settings_of(payload)[0x3] == 1
        frames = [await next_frame() for _ in range(5)]  # WINDOW_UPDATE, ACK, RST, HEADERS, DATA
        assert (RST_STREAM, 3, REFUSED) in frames
        assert (DATA, 1, grpc(b"hi")) in frames
    finally:
        writer.close()
        await server.stop(grace=0)


# -- flow control --------------------------------------------------------------------------------


def test_outbound_data_waits_for_window_updates() -> None:
    peer = Peer(initial_window=10)
    peer.open(1, end=True)
    peer.conn.send_message(1, b"A" * 20)  # 25 bytes framed
    peer.conn.finish(1)
    frames = peer.read()
    assert [(k, len(p)) for k, _, _, p in frames] == [(HEADERS, len(frames[0][3])), (DATA, 10)]
    peer.send(window_update(1, 100))  # the connection window (65535 - 10) allows the rest
    assert next((k, len(p)) for k, _, _, p in peer.read()) == (DATA, 15)
    assert 1 not in peer.conn.streams


def test_connection_window_blocks_every_stream_until_updated() -> None:
    peer = Peer(initial_window=1 << 20)
    peer.open(1, end=True)
    peer.conn.send_message(1, b"B" * 70_000)  # more than the 65,535-byte connection window
    sent = sum(len(p) for k, _, _, p in peer.read() if k == DATA)
    assert sent == 65535
    peer.conn.finish(1)
    assert peer.read() == []  # the trailers wait behind the data
    peer.send(window_update(0, 10_000))
    rest = peer.read()
    assert [k for k, _, _, _ in rest] == [DATA, HEADERS]
    assert sent + len(rest[0][3]) == 70_005


def test_settings_change_the_open_streams_windows_and_frame_size() -> None:
    peer = Peer(initial_window=0)
    peer.open(1, end=True)
    peer.conn.send_message(1, b"C" * 40_000)
    assert [k for k, _, _, _ in peer.read()] == [HEADERS]
    peer.send(settings(initial_window=1 << 20, max_frame=20_000))
    frames = peer.read()
    assert [len(p) for k, _, _, p in frames if k == DATA] == [20_000, 20_000, 5]
    assert (SETTINGS, ACK) in [(k, f) for k, f, _, _ in frames]


def test_inbound_windows_are_topped_up_and_enforced() -> None:
    peer = Peer()
    peer.open(1)
    chunk = grpc(b"x" * 60_000)
    for _ in range(40):  # 2.4 MB over one stream: past half the 4 MiB stream window
        assert all(isinstance(e, MessageReceived) for e in peer.send(frame(DATA, 0, 1, chunk)))
    updates = [(s, struct.unpack(">I", p)[0]) for k, _, s, p in peer.read() if k == WINDOW_UPDATE]
    assert updates and updates[0][0] == 1 and updates[0][1] >= 2 << 20

    # One frame over a (small) stream window: a stream error, the connection carries on.
    peer = Peer(stream_window=65536)
    peer.open(1)
    assert peer.send(frame(DATA, 0, 1, grpc(b"y" * 70_000))) == [StreamReset(1, FLOW_CONTROL_ERROR)]
    assert (RST_STREAM, 1) in [(k, s) for k, _, s, _ in peer.read()]
    assert not peer.conn.closed


# -- resets, gRPC errors, shutdown -----------------------------------------------------------------


def test_rst_stream_from_the_peer() -> None:
    peer = Peer()
    peer.open(1)
    assert peer.send(frame(RST_STREAM, 0, 1, struct.pack(">I", CANCEL))) == [StreamReset(1, CANCEL)]
    assert peer.send(frame(DATA, 0, 1, grpc(b"late"))) == []
    assert peer.conn.send_message(1, b"nobody") is False


def test_data_after_end_stream_is_a_stream_error() -> None:
    peer = Peer()
    peer.open(1, end=True)
    assert peer.send(frame(DATA, 0, 1, grpc(b"x"))) == [StreamReset(1, STREAM_CLOSED)]


@pytest.mark.parametrize(("message", "status"), [
    (grpc(b"zipped", compressed=True), "13"),
    (struct.pack(">BI", 0, 1 << 20), "8"),  # over max_message_bytes
])
def test_refused_messages_end_the_call(message: bytes, status: str) -> None:
    peer = Peer()
    peer.open(1)
    assert peer.send(frame(DATA, 0, 1, message)) == [StreamReset(1, CANCEL)]
    frames = peer.read()
    assert [k for k, _, _, _ in frames] == [HEADERS, RST_STREAM]
    assert peer.headers_of(frames[0][3])["grpc-status"] == status


def test_goaway_refuses_new_streams_and_lets_open_ones_finish() -> None:
    peer = Peer()
    peer.open(1)
    peer.conn.goaway()
    assert struct.unpack(">II", peer.read()[0][3][:8]) == (1, NO_ERROR)
    assert peer.open(3) == []
    assert peer.read() == [(RST_STREAM, 0, 3, struct.pack(">I", REFUSED_STREAM))]
    assert peer.send(frame(DATA, END_STREAM, 1, grpc(b"last"))) == [
        MessageReceived(1, b"last"), InputEnded(1)]


def test_drain_takes_the_streams_crossing_its_goaway_until_the_ping_ack() -> None:
    peer = Peer()
    peer.open(1)
    peer.conn.drain()
    (goaway, _, _, first), (ping, flags, _, opaque) = peer.read()
    assert (goaway, ping, flags) == (GOAWAY, PING, 0)
    assert struct.unpack(">II", first[:8]) == (0x7FFFFFFF, NO_ERROR)
    # Sent before the peer read the GOAWAY: still served.
    [opened] = peer.open(3)
    assert isinstance(opened, StreamOpened) and opened.stream_id == 3
    peer.send(frame(PING, ACK, 0, b"elsewhat"))  # not our PING: nothing changes
    assert peer.read() == [] and not peer.conn.goaway_sent
    peer.send(frame(PING, ACK, 0, opaque))
    [(kind, _, _, final)] = peer.read()
    assert kind == GOAWAY and struct.unpack(">II", final[:8]) == (3, NO_ERROR)
    assert peer.open(5) == []
    assert peer.read() == [(RST_STREAM, 0, 5, struct.pack(">I", REFUSED_STREAM))]
    peer.conn.drain()  # once is enough
    assert peer.read() == []


# -- malformed input: a connection error, never an exception ---------------------------------------


@pytest.mark.parametrize(("wire", "code"), [
    (frame(HEADERS, END_HEADERS, 0, b"\x82"), PROTOCOL_ERROR),
    (frame(HEADERS, END_HEADERS, 2, b"\x82"), PROTOCOL_ERROR),
    (frame(CONTINUATION, END_HEADERS, 1, b"\x82"), PROTOCOL_ERROR),
    (frame(HEADERS, 0, 1, b"\x83") + frame(PING, 0, 0, b"12345678"), PROTOCOL_ERROR),
    (frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\x7f"), COMPRESSION_ERROR),
    (frame(HEADERS, END_HEADERS | PADDED, 1, b"\x09abc"), PROTOCOL_ERROR),
    (frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
    (frame(DATA, 0, 9, b"x"), PROTOCOL_ERROR),
    (frame(PING, 0, 0, b"1234"), FRAME_SIZE_ERROR),
    (frame(PING, 0, 1, b"12345678"), PROTOCOL_ERROR),
    (frame(SETTINGS, 0, 0, b"\x00\x04\x00"), FRAME_SIZE_ERROR),
    (frame(SETTINGS, 0, 1, b""), PROTOCOL_ERROR),
    (frame(SETTINGS, ACK, 0, b"\x00\x00\x00\x00\x00\x00"), FRAME_SIZE_ERROR),
    (settings(max_frame=100), PROTOCOL_ERROR),
    (settings(initial_window=2**31), FLOW_CONTROL_ERROR),
    (settings(enable_push=2), PROTOCOL_ERROR),
    (window_update(0, 0), PROTOCOL_ERROR),
    (window_update(0, 2**31 - 1), FLOW_CONTROL_ERROR),
    (frame(WINDOW_UPDATE, 0, 0, b"\x00"), FRAME_SIZE_ERROR),
    (frame(RST_STREAM, 0, 7, struct.pack(">I", 8)), PROTOCOL_ERROR),
    (frame(RST_STREAM, 0, 0, b"\x00"), FRAME_SIZE_ERROR),
    (frame(PRIORITY, 0, 1, b"\x00"), FRAME_SIZE_ERROR),
    (frame(5, END_HEADERS, 1, b"\x00\x00\x00\x02"), PROTOCOL_ERROR),  # PUSH_PROMISE
    (b"\x10\x00\x01" + b"\x00" * 6, FRAME_SIZE_ERROR),  # 1 MiB + 1 byte frame announced
])
def test_malformed_input_is_a_connection_error(wire: bytes, code: int) -> None:
    peer = Peer()
    events = peer.send(wire)
    assert events[-1] == ConnectionEnded(code, events[-1].reason)
    assert goaway_code(peer.read()) == code
    assert peer.conn.closed and peer.send(frame(PING, 0, 0, b"12345678")) == []


@pytest.mark.parametrize("start", [b"GET / HTTP/1.1\r\n\r\n",
                                   PREFACE + frame(PING, 0, 0, b"8" * 8)])
def test_bad_preface_is_a_protocol_error(start: bytes) -> None:
    conn = H2GrpcConnection()
    [event] = conn.receive(start)
    assert isinstance(event, ConnectionEnded) and event.error_code == PROTOCOL_ERROR


def test_unknown_frame_types_are_ignored() -> None:
    peer = Peer()
    assert peer.send(frame(0xEE, 0xFF, 1, b"whatever")) == []
    assert not peer.conn.closed


def test_random_garbage_ends_the_connection_with_a_protocol_error_not_a_bug() -> None:
    """Garbage after a good preface gives well-formed events; when it ends the connection, that
    is one ConnectionEnded naming an HTTP/2 error the input caused (never INTERNAL_ERROR, the
    code of a caught bug) and a GOAWAY with the same code; afterwards nothing is read."""
    rng = random.Random(7)
    ended = 0
    for _ in range(300):
        peer = Peer()
        peer.open(1)
        garbage = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        events: list[Any] = []
        for i in range(0, len(garbage), 13):
            events += peer.send(garbage[i:i + 13])
        assert all(isinstance(e, (StreamOpened, MessageReceived, InputEnded, StreamReset,
                                  ConnectionEnded)) for e in events), events
        endings = [e for e in events if isinstance(e, ConnectionEnded)]
        assert len(endings) == (1 if peer.conn.closed else 0), garbage
        if endings:
            ended += 1
            assert endings[0].error_code != INTERNAL_ERROR, (garbage, endings[0].reason)
            assert events[-1] is endings[0]
            assert goaway_code(peer.read()) == endings[0].error_code
            assert peer.send(b"\x00" * 9) == []
    assert ended > 250  # random bytes are almost never a valid frame sequence


def test_cached_blocks_follow_dynamic_table_changes() -> None:
    """Envoy's blocks mix indexed fields and non-indexed literals; a cached decode is only
    reused while the dynamic table is unchanged (an index may name another entry after)."""
    peer = Peer()
    peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, peer.headers_block(**{"x-a": "1"})))
    # Dynamic index 62 is now x-a: 1; a block naming it by index, plus a never-indexed literal.
    block = b"\xbe" + b"\x10" + bytes((5,)) + b"x-lit" + bytes((1,)) + b"v"
    base = peer.headers_block()  # indexed only now
    first = peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 3, base + block))[0]
    again = peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 5, base + block))[0]
    assert first.headers["x-a"] == again.headers["x-a"] == "1"
    assert again.headers["x-lit"] == "v"
    peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 7, peer.headers_block(**{"x-b": "2"})))
    base = peer.headers_block()  # the same fields, now one index further
    moved = peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 9, base + block))[0]
    assert moved.headers.get("x-b") == "2" and "x-a" not in moved.headers


def test_a_message_over_many_frames_and_reads_arrives_whole() -> None:
    peer = Peer()
    peer.conn.max_message_bytes = 1 << 20
    peer.open(1)
    message = bytes(range(256)) * 800
    data = grpc(message)
    wire = b"".join(frame(DATA, 0, 1, data[i:i + 16384]) for i in range(0, len(data), 16384))
    events = []
    for i in range(0, len(wire), 5000):
        events += peer.send(wire[i:i + 5000])
    assert events == [MessageReceived(1, message)]
