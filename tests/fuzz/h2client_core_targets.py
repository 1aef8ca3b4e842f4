"""Fuzz target for the gRPC client's sans-IO core (`kvswitch.protocol.h2client_core`):
`h2-client-core` starts two calls, then feeds a server's frames (well-formed responses, messages,
trailers, resets, pings, or cut and mutated frames) whole and cut at two points. Where the bytes
are cut changes nothing a call sees (its messages, how it ended) nor how the connection ended;
`receive()` never raises; a call ends once and gets nothing after; a connection error writes
GOAWAY and ends every call; what the core writes is whole frames."""

from __future__ import annotations

import struct

from hypothesis import strategies as st

from kvswitch.protocol.h2client_core import (
    CallEnded,
    ConnectionEnded,
    H2ClientConnection,
    MessagesReceived,
)
from kvswitch.protocol.http2 import (
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PADDED,
    RST_STREAM,
    SETTINGS,
    frame,
)
from tests.fuzz.base import Target, mutated
from tests.fuzz.raw import Codec

__all__ = ["H2_CLIENT_CORE"]

_STREAMS = (1, 3)


def _message(payload: bytes, flag: int = 0) -> bytes:
    return bytes((flag,)) + struct.pack(">I", len(payload)) + payload


_stream = st.sampled_from([1, 1, 1, 3, 3, 3, 5, 2])  # mostly the calls started
_status = st.sampled_from(["0", "5", "x", "200"])
_data = st.builds(
    lambda sid, messages, cut, end, pad: frame(
        DATA, (END_STREAM if end else 0) | (PADDED if pad else 0), sid,
        (b"\x02" if pad else b"") + b"".join(messages)[cut:] + (b"\x00\x00" if pad else b"")),
    _stream, st.lists(st.builds(_message, st.binary(max_size=20),
                                st.sampled_from([0, 0, 0, 0, 1])), max_size=3),
    st.sampled_from([0, 0, 0, 0, 3, 7]), st.booleans(), st.booleans())
_literal = st.builds(lambda fields: b"".join(
    b"\x00" + bytes((len(k),)) + k.encode() + bytes((len(v),)) + v.encode() for k, v in fields),
    st.lists(st.tuples(st.sampled_from([":status", "grpc-status", "grpc-message"]),
                       st.one_of(_status, st.text("abc%2", max_size=6))), max_size=3))
_headers = st.builds(lambda sid, block, end: frame(
    HEADERS, END_HEADERS | (END_STREAM if end else 0), sid, block), _stream, _literal,
    st.booleans())
_control = st.sampled_from([
    frame(RST_STREAM, 0, 1, struct.pack(">I", 7)), frame(RST_STREAM, 0, 3, struct.pack(">I", 8)),
    frame(GOAWAY, 0, 0, struct.pack(">II", 1, 0)), frame(6, 0, 0, b"pingping"),
    frame(6, 1, 0, b"kvswkeep"), frame(8, 0, 1, struct.pack(">I", 100)),
    frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 10))])
_frame = st.one_of(_data, _headers, _control)
_input = st.lists(st.one_of(_frame, _frame, mutated(_frame)), max_size=10).map(b"".join)


def _whole_frames(data: bytes) -> list[int]:
    kinds, offset = [], 0
    while offset < len(data):
        length = int.from_bytes(data[offset:offset + 3], "big")
        assert offset + 9 + length <= len(data), "a frame written in part"
        kinds.append(data[offset + 3])
        offset += 9 + length
    return kinds


def _run(pieces: list[bytes]) -> tuple[dict[int, tuple[list[bytes], int | None]], int | None]:
    """What each call saw (its messages, its end status) and the connection error's code."""
    conn = H2ClientConnection("fuzz:1")
    conn.initiate()
    for sid in _STREAMS:
        assert conn.start_call("/x.Y/Z", (), b"q") == sid
    written = conn.data_to_send()
    calls: dict[int, tuple[list[bytes], int | None]] = {sid: ([], None) for sid in _STREAMS}
    failed = None
    for piece in pieces:
        for event in conn.receive(piece):  # never raises
            if isinstance(event, MessagesReceived):
                assert calls[event.stream_id][1] is None, "a message after the call ended"
                calls[event.stream_id][0].extend(event.messages)
            elif isinstance(event, CallEnded):
                messages, ended = calls[event.stream_id]
                assert ended is None, "a call ended twice"
                calls[event.stream_id] = (messages, event.status)
            elif isinstance(event, ConnectionEnded):
                assert failed is None
                failed = event.error_code
        written += conn.data_to_send()
    kinds = _whole_frames(written[24:])
    if failed is not None:
        assert kinds[-1] == GOAWAY and conn.calls == {}
        assert all(status is not None for _, status in calls.values())
        assert conn.receive(frame(SETTINGS, 0, 0)) == []
    return calls, failed


def check_h2_client_core(args: tuple[bytes, int, int]) -> None:
    data, first, second = args
    stream = frame(SETTINGS, 0, 0) + data
    first, second = sorted((min(first, len(stream)), min(second, len(stream))))
    assert _run([stream[:first], stream[first:second], stream[second:]]) == _run([stream])


H2_CLIENT_CORE = Target("h2-client-core", st.tuples(_input, st.integers(0, 300),
                                                    st.integers(0, 300)), check_h2_client_core,
                        Codec("bytes", (255, 255)))
