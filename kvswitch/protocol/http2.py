"""HTTP/2 framing shared by kvswitch's own gRPC transports (RFC 9113, RFC 7541).

Used by the EPP's ext_proc server (`kvswitch.epp.h2connection`) and the gRPC client
(`kvswitch.protocol.h2client`: the frontend's Generate calls, the EPP's data layer): frame
types, flags and error codes, one frame's bytes,
and header encoding as HPACK literals without indexing (no Huffman), which touches no HPACK
state, so a header block is a plain concatenation that can be built once and reused.
"""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
DEFAULT_WINDOW = 65535
MAX_WINDOW = 2**31 - 1

U32 = struct.Struct(">I")
"""Big-endian u32: stream ids, window increments, error codes (the frame length is its low
24 bits: `U32.unpack_from(buf, offset)[0] >> 8` reads it from the frame's first 4 bytes)."""


FRAME_HEADER = struct.Struct(">HBBBI")
"""A frame's 9-byte header as (length >> 8, length & 0xFF, type, flags, stream id): one pack
call for the 24-bit length."""


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    size = len(payload)
    return FRAME_HEADER.pack(size >> 8, size & 0xFF, kind, flags, stream_id) + payload


def hpack_int(value: int, bits: int, flags: int = 0) -> bytes:
    """HPACK's prefixed integer (RFC 7541 §5.1)."""
    limit = (1 << bits) - 1
    if value < limit:
        return bytes((flags | value,))
    out = bytearray((flags | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_literal(name: str, value: str) -> bytes:
    """A header as "literal without indexing, new name", no Huffman (RFC 7541 §6.2.2)."""
    raw_name, raw_value = name.encode("latin-1"), value.encode("latin-1", "replace")
    return (b"\x00" + hpack_int(len(raw_name), 7) + raw_name
            + hpack_int(len(raw_value), 7) + raw_value)
