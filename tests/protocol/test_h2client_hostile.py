"""A hostile or broken server against the HTTP/2 gRPC client: malformed frames (found by the
h2-client fuzz target, kept here) are connection errors — a GOAWAY naming the error, the
connection closed, every open call UNAVAILABLE — never an exception out of data_received."""

from __future__ import annotations

import struct

import grpc
import pytest

from kvswitch.protocol import GENERATE_PATH, h2client
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.http2 import (
    CONTINUATION,
    DATA,
    ENHANCE_YOUR_CALM,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PROTOCOL_ERROR,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    hpack_literal,
)
from tests.fuzz.base import FakeTransport


def goaway_code(written: bytes) -> int | None:
    offset = written.find(b"\x07\x00\x00\x00\x00\x00")  # a GOAWAY header on stream 0
    if offset < 3:
        return None
    return struct.unpack_from(">I", written, offset + 6 + 4)[0]


@pytest.mark.parametrize(("data", "code"), [
    (frame(RST_STREAM, 0, 1, b""), FRAME_SIZE_ERROR),
    (frame(GOAWAY, 0, 0, b"\x00"), FRAME_SIZE_ERROR),
    (frame(WINDOW_UPDATE, 0, 0, b"\x00\x01"), FRAME_SIZE_ERROR),
    (frame(PING, 0, 0, b"1234"), FRAME_SIZE_ERROR),
    (frame(SETTINGS, 0, 0, b"\x00\x03\x00"), FRAME_SIZE_ERROR),
    (frame(DATA, PADDED, 1, b""), PROTOCOL_ERROR),
    (frame(DATA, PADDED, 1, b"\x09abc"), PROTOCOL_ERROR),
    (frame(HEADERS, PADDED, 1, b""), PROTOCOL_ERROR),
    (frame(CONTINUATION, 0, 1, b"x"), PROTOCOL_ERROR),
    (frame(HEADERS, 0, 1, b"x") + b"".join(frame(CONTINUATION, 0, 1, b"x" * 16384)
                                          for _ in range(17)), ENHANCE_YOUR_CALM),
    (frame(HEADERS, 0, 1, b"x") + frame(DATA, 0, 1, b"y"), PROTOCOL_ERROR),
    (b"\x20\x00\x00\x00\x00\x00\x00\x00\x01", FRAME_SIZE_ERROR),  # a 32 MiB frame announced
    (frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)), 0x3),
])
async def test_a_malformed_frame_is_a_connection_error(data: bytes, code: int) -> None:
    conn = h2client._Connection("test:1")
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    call = conn.start(GENERATE_PATH, (), b"x", pb.GenerateResponse.FromString)
    transport.out.clear()
    conn.data_received(frame(SETTINGS, 0, 0) + data)
    assert transport.closed and conn.closed
    assert goaway_code(b"".join(transport.out)) == code
    with pytest.raises(h2client.StreamError) as caught:
        await call.read_batch()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    conn.data_received(frame(PING, 0, 0, b"12345678"))  # nothing more is read
    assert b"".join(transport.out).count(b"12345678") == 0


async def test_a_well_formed_padded_response_is_read() -> None:
    conn = h2client._Connection("test:1")
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    call = conn.start(GENERATE_PATH, (), b"x", pb.GenerateResponse.FromString)
    message = pb.GenerateResponse(complete=pb.GenerateComplete(finish_reason="stop"))
    body = message.SerializeToString()
    grpc_message = b"\x00" + struct.pack(">I", len(body)) + body
    head = hpack_literal(":status", "200") + hpack_literal("content-type", "application/grpc")
    trailers = hpack_literal("grpc-status", "0")
    conn.data_received(frame(SETTINGS, 0, 0)
                       + frame(HEADERS, 0x4 | PADDED, 1, b"\x02" + head + b"\x00\x00")
                       + frame(DATA, PADDED, 1, b"\x03" + grpc_message + b"\x00" * 3)
                       + frame(HEADERS, 0x5, 1, trailers))
    assert not transport.closed
    assert [m.complete.finish_reason for m in await call.read_batch()] == ["stop"]
