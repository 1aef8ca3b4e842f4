"""The gRPC client's sans-IO core (`H2ClientConnection`) frame by frame: exact frames in, the
events and the frames it writes out, as the `h2` library's own tests do."""

from __future__ import annotations

import struct

import pytest
from hpack import Decoder, Encoder

from kvswitch.protocol.h2client_core import (
    MAX_HEADER_BLOCK,
    MAX_RESPONSE_MESSAGE,
    CallEnded,
    ConnectionEnded,
    GoAwayReceived,
    H2ClientConnection,
    MessagesReceived,
    PingAcked,
)
from kvswitch.protocol.http2 import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_FRAME,
    PADDED,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)

PATH = "/x.Y/Z"
OK, UNKNOWN, NOT_FOUND, RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE = 0, 2, 5, 8, 13, 14


def grpc(message: bytes, flag: int = 0) -> bytes:
    return bytes((flag,)) + struct.pack(">I", len(message)) + message


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each whole frame in `data`."""
    out, offset = [], 0
    while offset < len(data):
        length = int.from_bytes(data[offset:offset + 3], "big")
        kind, flags = data[offset + 3], data[offset + 4]
        stream_id = struct.unpack_from(">I", data, offset + 5)[0]
        out.append((kind, flags, stream_id, data[offset + 9:offset + 9 + length]))
        offset += 9 + length
    assert offset == len(data)
    return out


class Peer:
    """A server's side of the exchange, written by hand (its HPACK by `hpack`)."""

    def __init__(self) -> None:
        self.encoder = Encoder()

    def headers(self, stream_id: int, fields: list[tuple[str, str]], end: bool = False) -> bytes:
        return frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), stream_id,
                     self.encoder.encode(fields))

    def response(self, stream_id: int) -> bytes:
        return self.headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])

    def trailers(self, stream_id: int, status: str = "0", message: str = "") -> bytes:
        fields = [("grpc-status", status)] + ([("grpc-message", message)] if message else [])
        return self.headers(stream_id, fields, end=True)


def connected(calls: int = 1, scheme: str = "http") -> tuple[H2ClientConnection, Peer]:
    """A core that has started `calls` calls and read the server's SETTINGS; what it wrote so
    far is taken."""
    conn = H2ClientConnection("engine:1", scheme=scheme)
    conn.initiate()
    for _ in range(calls):
        assert conn.start_call(PATH, [("x-tenant", "a")], b"req") is not None
    assert conn.receive(frame(SETTINGS, 0, 0)) == []
    conn.data_to_send()
    return conn, Peer()


def test_initiate_writes_the_preface_settings_and_the_connection_window() -> None:
    conn = H2ClientConnection("engine:1")
    conn.initiate()
    out = conn.data_to_send()
    assert out.startswith(PREFACE)
    (kind, flags, sid, payload), update = frames(out[len(PREFACE):])
    assert (kind, flags, sid) == (SETTINGS, 0, 0)
    assert dict(struct.iter_unpack(">HI", payload)) == {
        0x2: 0, 0x4: 2**31 - 1, 0x5: MAX_FRAME, 0x6: MAX_HEADER_BLOCK}
    assert update == (WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1 - 65535))


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_call_is_its_headers_then_its_one_message_ending_the_stream(scheme: str) -> None:
    conn = H2ClientConnection("engine:1", scheme=scheme)
    conn.start_call(PATH, [("x-tenant", "a")], b"req", timeout=2.5)
    (kind, flags, sid, block), data = frames(conn.data_to_send())
    assert (kind, flags, sid) == (HEADERS, END_HEADERS, 1)
    assert Decoder().decode(block) == [
        (":method", "POST"), (":scheme", scheme), (":path", PATH), (":authority", "engine:1"),
        ("content-type", "application/grpc"), ("te", "trailers"),
        ("user-agent", "kvswitch-frontend"), ("grpc-timeout", "2500m"), ("x-tenant", "a")]
    assert data == (DATA, END_STREAM, 1, grpc(b"req"))
    assert conn.start_call(PATH, (), b"") == 3  # client streams are odd, rising


def test_a_scheme_other_than_http_or_https_is_refused() -> None:
    with pytest.raises(ValueError):
        H2ClientConnection("engine:1", scheme="ftp")


def test_messages_cut_anywhere_arrive_whole_and_trailers_end_the_call() -> None:
    conn, peer = connected()
    body = grpc(b"one") + grpc(b"") + grpc(b"three" * 1000)
    events = conn.receive(peer.response(1) + frame(DATA, 0, 1, body[:10]))
    assert events == [MessagesReceived(1, [b"one"])]
    events = conn.receive(frame(DATA, 0, 1, body[10:20]) + frame(DATA, 0, 1, body[20:]))
    assert events == [MessagesReceived(1, [b"", b"three" * 1000])]
    assert conn.receive(peer.trailers(1)) == [CallEnded(1, OK, "")]
    assert conn.calls == {}


def test_padded_data_counts_its_padding_against_the_windows() -> None:
    conn, peer = connected()
    payload = grpc(b"x")
    padded = bytes((4,)) + payload + b"\x00" * 4
    events = conn.receive(peer.response(1) + frame(DATA, PADDED, 1, padded))
    assert events == [MessagesReceived(1, [b"x"])]
    assert conn.calls[1].recv_unacked == len(padded)


@pytest.mark.parametrize(("status", "message", "expected"), [
    ("5", "no such %25 thing", (NOT_FOUND, "no such % thing")),
    ("x", "", (UNKNOWN, "grpc-status 'x': ")),
])
def test_an_error_status_ends_the_call_with_its_details(status: str, message: str,
                                                        expected: tuple[int, str]) -> None:
    conn, peer = connected()
    assert conn.receive(peer.trailers(1, status, message)) == [CallEnded(1, *expected)]


def test_an_http_error_status_maps_to_its_grpc_status() -> None:
    conn, peer = connected()
    events = conn.receive(peer.headers(1, [(":status", "503")]))
    assert events == [CallEnded(1, UNAVAILABLE, "HTTP status 503")]


def test_a_stream_ended_by_data_without_trailers_is_internal() -> None:
    conn, peer = connected()
    events = conn.receive(peer.response(1) + frame(DATA, END_STREAM, 1, grpc(b"a")))
    assert events == [MessagesReceived(1, [b"a"]),
                      CallEnded(1, INTERNAL, "stream ended without trailers")]


def test_trailers_inside_a_message_end_the_call_internal_and_reset_it() -> None:
    conn, peer = connected()
    conn.receive(peer.response(1) + frame(DATA, 0, 1, grpc(b"abc")[:6]))
    [ended] = conn.receive(peer.trailers(1))
    assert ended.status == INTERNAL
    assert frames(conn.data_to_send()) == [(RST_STREAM, 0, 1, struct.pack(">I", 0x8))]


def test_a_reset_from_the_server_ends_only_its_call() -> None:
    conn, _ = connected(calls=2)
    events = conn.receive(frame(RST_STREAM, 0, 3, struct.pack(">I", 0x7)))
    assert events == [CallEnded(3, UNAVAILABLE, "stream reset by the server (HTTP/2 error 7)")]
    assert list(conn.calls) == [1]


def test_a_message_over_the_limit_or_compressed_fails_its_call_and_resets_it() -> None:
    conn, peer = connected(calls=2)
    too_long = b"\x00" + struct.pack(">I", MAX_RESPONSE_MESSAGE + 1)
    events = conn.receive(peer.response(1) + peer.response(3) + frame(DATA, 0, 1, too_long)
                          + frame(DATA, 0, 3, grpc(b"ok") + grpc(b"z", flag=1)))
    assert [(type(e), e.stream_id) for e in events] == [
        (CallEnded, 1), (MessagesReceived, 3), (CallEnded, 3)]
    assert events[0].status == RESOURCE_EXHAUSTED and events[2].status == INTERNAL
    assert events[1].messages == [b"ok"]  # those before the bad one still count
    assert [(k, sid) for k, _, sid, _ in frames(conn.data_to_send())] == [
        (RST_STREAM, 1), (RST_STREAM, 3)]


def test_pings_are_answered_and_our_pings_acks_reported() -> None:
    conn, _ = connected()
    conn.ping(b"keepaliv")
    assert frames(conn.data_to_send()) == [(PING, 0, 0, b"keepaliv")]
    assert conn.receive(frame(PING, ACK, 0, b"keepaliv")) == [PingAcked(b"keepaliv")]
    assert conn.receive(frame(PING, 0, 0, b"12345678")) == []
    assert frames(conn.data_to_send()) == [(PING, ACK, 0, b"12345678")]


def test_goaway_fails_the_calls_the_server_did_not_take_and_no_new_call_starts() -> None:
    conn, _ = connected(calls=2)
    events = conn.receive(frame(GOAWAY, 0, 0, struct.pack(">II", 1, 0)))
    assert events == [CallEnded(3, UNAVAILABLE, "connection closing (GOAWAY)"),
                      GoAwayReceived(1, 0)]
    assert conn.closed and list(conn.calls) == [1]
    assert conn.start_call(PATH, (), b"") is None


def test_a_body_over_the_peers_window_is_not_started() -> None:
    conn = H2ClientConnection("engine:1")
    conn.initiate()
    conn.receive(frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 10)))
    assert conn.start_call(PATH, (), b"x" * 6) is None
    assert conn.start_call(PATH, (), b"x" * 5) == 1


def test_the_stream_window_is_given_back_once_the_refill_point_is_reached() -> None:
    conn, peer = connected()
    conn.calls[1].refill_at = 20
    conn.receive(peer.response(1) + frame(DATA, 0, 1, grpc(b"a" * 10)))
    assert conn.data_to_send() == b""
    conn.receive(frame(DATA, 0, 1, grpc(b"b" * 10)))
    assert frames(conn.data_to_send()) == [(WINDOW_UPDATE, 0, 1, struct.pack(">I", 30))]


def test_data_beyond_the_stream_window_fails_the_call_with_flow_control_error() -> None:
    conn, peer = connected()
    conn.calls[1].recv_window = 4
    [ended] = conn.receive(peer.response(1) + frame(DATA, 0, 1, grpc(b"a")))
    assert ended.status == INTERNAL
    assert frames(conn.data_to_send()) == [(RST_STREAM, 0, 1, struct.pack(">I", 0x3))]


@pytest.mark.parametrize(("data", "code"), [
    (frame(DATA, 0, 5, grpc(b"a")), PROTOCOL_ERROR),  # a stream never opened
    (frame(HEADERS, END_HEADERS, 2, b"\x88"), PROTOCOL_ERROR),  # a server-initiated stream
    (frame(RST_STREAM, 0, 7, b"\x00\x00\x00\x08"), PROTOCOL_ERROR),
    (frame(DATA, PADDED, 1, b"\x09abc"), PROTOCOL_ERROR),  # padding past the frame
    (b"\x10\x00\x01\x00\x00\x00\x00\x00\x01", FRAME_SIZE_ERROR),  # over MAX_FRAME
    (frame(CONTINUATION, END_HEADERS, 1, b"\x88"), PROTOCOL_ERROR),
    (frame(HEADERS, 0, 1, b"\x00" * (MAX_HEADER_BLOCK + 1)), ENHANCE_YOUR_CALM),
    (frame(PING, 0, 0, b"short"), FRAME_SIZE_ERROR),
])
def test_a_broken_rule_ends_the_connection_with_goaway_and_fails_every_call(
        data: bytes, code: int) -> None:
    conn, _ = connected(calls=1)
    events = conn.receive(data)
    assert [type(e) for e in events] == [CallEnded, ConnectionEnded]
    assert events[0].status == UNAVAILABLE and events[1].error_code == code
    [(kind, _, _, payload)] = frames(conn.data_to_send())
    assert kind == GOAWAY and struct.unpack_from(">II", payload) == (0, code)
    assert conn.failed and conn.closed and conn.calls == {}
    assert conn.receive(frame(PING, 0, 0, b"12345678")) == []  # nothing more is read


def test_messages_before_a_broken_frame_still_arrive() -> None:
    conn, peer = connected()
    events = conn.receive(peer.response(1) + frame(DATA, 0, 1, grpc(b"kept"))
                          + frame(PING, 0, 3, b"12345678"))
    assert [type(e) for e in events] == [MessagesReceived, CallEnded, ConnectionEnded]
    assert events[0].messages == [b"kept"]


def test_lost_fails_every_open_call_and_reset_writes_nothing_after() -> None:
    conn, _ = connected(calls=2)
    assert conn.lost("gone") == [CallEnded(1, UNAVAILABLE, "gone"),
                                 CallEnded(3, UNAVAILABLE, "gone")]
    conn.reset(1)
    assert conn.data_to_send() == b"" and conn.start_call(PATH, (), b"") is None
