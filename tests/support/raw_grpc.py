"""A hostile gRPC client: one call whose request body is given byte for byte (any framing, any
compression flag), over a plain socket speaking HTTP/2 with prior knowledge. Returns the call's
grpc-status and grpc-message, or raises TimeoutError when the server gives no answer."""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import Sequence

import hpack

from kvswitch.protocol.http2 import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    hpack_literal,
)

_FRAME = 16384


def grpc_frame(message: bytes, *, compressed: bool = False, declared: int | None = None
               ) -> bytes:
    """One length-prefixed gRPC message; `declared` overrides the length prefix."""
    return (b"\x01" if compressed else b"\x00") + struct.pack(
        ">I", len(message) if declared is None else declared) + message


def gzip_bytes(*parts: bytes, repeat_last: int = 1) -> bytes:
    """gzip of the parts, the last one repeated `repeat_last` times (a bomb, built lazily)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [compressor.compress(p) for p in parts[:-1]]
    out.extend(compressor.compress(parts[-1]) for _ in range(repeat_last))
    out.append(compressor.flush())
    return b"".join(out)


async def call(port: int, path: str, body: bytes, *, timeout: float = 10.0,
               headers: Sequence[tuple[str, str]] = ()) -> tuple[int, str]:
    """(grpc-status, grpc-message) of one call with this exact request body."""
    block = b"".join(hpack_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "test"),
        ("content-type", "application/grpc"), ("te", "trailers"), *headers))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        out = [PREFACE, frame(SETTINGS, 0, 0), frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**30)),
               frame(HEADERS, END_HEADERS, 1, block)]
        for start in range(0, max(len(body), 1), _FRAME):
            last = start + _FRAME >= len(body)
            out.append(frame(DATA, END_STREAM if last else 0, 1, body[start:start + _FRAME]))
        writer.write(b"".join(out))
        async with asyncio.timeout(timeout):
            return await _read_status(reader)
    finally:
        writer.close()


async def _read_status(reader: asyncio.StreamReader) -> tuple[int, str]:
    decoder = hpack.Decoder()
    decoder.max_allowed_table_size = 2**16
    while True:
        head = await reader.readexactly(9)
        length = int.from_bytes(head[:3], "big")
        kind, stream = head[3], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
        payload = await reader.readexactly(length)
        if kind == HEADERS and stream == 1:
            fields = dict(decoder.decode(payload))
            if "grpc-status" in fields:
                return int(fields["grpc-status"]), fields.get("grpc-message", "")
