"""Floods at the EPP's HTTP/2 core: runs of frames that carry nothing (PING, SETTINGS,
PRIORITY, unknown types, empty DATA) past `MAX_IDLE_FRAMES` end the connection with
ENHANCE_YOUR_CALM; useful frames in between reset the count; the header list limit is
advertised; a peer that stops reading stops being read (write backpressure)."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from kvswitch.epp.h2connection import MAX_HEADER_LIST, MAX_IDLE_FRAMES
from kvswitch.epp.h2server import H2GrpcServer
from kvswitch.protocol.http2 import (
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    HEADERS,
    PING,
    PREFACE,
    PRIORITY,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    hpack_literal,
)
from tests.epp.test_h2server import Peer, goaway_code, grpc, settings_of

PING_FRAME = frame(PING, 0, 0, b"12345678")
HEADERS_BLOCK = b"".join(hpack_literal(k, v) for k, v in (
    (":method", "POST"), (":scheme", "http"), (":path", "/x.Y/Z"), (":authority", "epp"),
    ("content-type", "application/grpc"), ("te", "trailers")))


def test_the_header_list_limit_is_advertised() -> None:
    assert settings_of(Peer().frames[0][3])[0x6] == MAX_HEADER_LIST


@pytest.mark.parametrize("flood", [
    PING_FRAME,
    frame(SETTINGS, 0, 0),
    frame(PRIORITY, 0, 1, b"\x00\x00\x00\x00\x10"),
    frame(0x20, 0, 0, b"unknown"),
])
def test_a_flood_of_empty_frames_is_enhance_your_calm(flood: bytes) -> None:
    peer = Peer()
    peer.open(1)
    peer.send(flood * MAX_IDLE_FRAMES)
    assert not peer.conn.closed  # up to the limit: answered as usual
    peer.read()
    peer.send(flood)
    assert peer.conn.closed and goaway_code(peer.read()) == ENHANCE_YOUR_CALM


def test_a_flood_of_empty_data_frames_is_enhance_your_calm() -> None:
    peer = Peer()
    peer.open(1)
    peer.send(frame(DATA, 0, 1, b"") * (MAX_IDLE_FRAMES + 1))
    assert peer.conn.closed and goaway_code(peer.read()) == ENHANCE_YOUR_CALM


def test_useful_frames_reset_the_count() -> None:
    peer = Peer()
    peer.open(1)
    for stream_id in (3, 5, 7):  # long runs, each ended by a new stream or data
        peer.send(PING_FRAME * MAX_IDLE_FRAMES)
        peer.open(stream_id)
        peer.send(PING_FRAME * MAX_IDLE_FRAMES)
        peer.send(frame(DATA, 0, 1, grpc(b"x")))
    # Window updates and resets are not idle: a proxy sends long runs of them.
    peer.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1)) * (MAX_IDLE_FRAMES + 10))
    peer.send(b"".join(frame(RST_STREAM, 0, s, struct.pack(">I", 8)) for s in (1, 3, 5, 7)))
    assert not peer.conn.closed
    peer.send(frame(DATA, END_STREAM, 9, b""))  # a stream never opened: still an error
    assert peer.conn.closed


async def test_a_peer_that_does_not_read_is_not_read() -> None:
    server = H2GrpcServer({}, host="127.0.0.1", port=0)
    await server.start()
    try:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        sock.send(PREFACE + frame(SETTINGS, 0, 0))
        sent, blocked = 0, False
        # Calls (answered UNIMPLEMENTED) and PINGs whose answers we never read: once the
        # server's writes back up it stops reading, so our sends block too (bounded loop).
        for i in range(4000):
            chunk = frame(HEADERS, END_HEADERS | END_STREAM, 2 * i + 1, HEADERS_BLOCK)
            chunk += PING_FRAME * 1000
            try:
                sent += sock.send(chunk)
            except BlockingIOError:
                blocked = True
                break
            await asyncio.sleep(0)
        assert blocked and sent < 4000 * len(chunk)
        sock.close()
    finally:
        await server.stop(0)
