"""The HTTP/2 frame layer shared by kvswitch's own gRPC transports (RFC 9113, RFC 7541); no I/O.

Used by the EPP's ext_proc server (`kvswitch.epp.h2connection`) and the gRPC client
(`kvswitch.protocol.h2client_core`). `FrameReader` cuts frames out of received bytes and enforces
RFC 9113's frame-level rules: SETTINGS first (on the server side after the client's preface);
frame size against the advertised maximum; padding within its frame; the fixed lengths of PING,
SETTINGS, WINDOW_UPDATE, RST_STREAM, PRIORITY and GOAWAY; the stream (zero or not) each type
belongs on; CONTINUATION only right after the HEADERS or CONTINUATION of its stream; no
PUSH_PROMISE (both sides disable push); header blocks capped; floods (`MAX_IDLE_FRAMES`). A
broken rule raises `H2ProtocolError` (a connection error: GOAWAY with its code).
`HeaderDecoder` is HPACK decoding with the header list capped. Writing: `frame()`, header blocks
as HPACK literals without indexing (no Huffman; touching no HPACK state, so a block can be built
once and reused) and `header_frames()` to cut a block to the peer's frame size.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from hpack import Decoder, HPACKError, OversizedHeaderListError

from kvswitch.protocol.pieces import Pieces

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
DEFAULT_WINDOW = 65535
MAX_WINDOW = 2**31 - 1
DEFAULT_MAX_FRAME = 16384
SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 0x2, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

MAX_IDLE_FRAMES = 10_000
"""Frames in a row that cost work but carry nothing (PING, SETTINGS, PRIORITY, unknown types,
empty DATA that does not end its stream) before the connection counts as a flood
(ENHANCE_YOUR_CALM). WINDOW_UPDATE, RST_STREAM and the ACKs of our own PINGs and SETTINGS
neither count nor break a run: a proxy reading many responses or cancelling many calls sends
long runs of the first two, and a quiet connection's keepalive brings only the ACKs."""

MAX_FRAME = 1 << 20
"""SETTINGS_MAX_FRAME_SIZE both transports advertise and enforce (Envoy sends up to this once
told; larger frames only cost bigger buffers)."""

U32 = struct.Struct(">I")
"""Big-endian u32: stream ids, window increments, error codes."""

FRAME_HEADER = struct.Struct(">HBBBI")
"""A frame's 9-byte header as (length >> 8, length & 0xFF, type, flags, stream id): one pack
call for the 24-bit length."""

_SETTING = struct.Struct(">HI")
_FIXED_LENGTH = {PRIORITY: 5, RST_STREAM: 4, PING: 8, WINDOW_UPDATE: 4}
_ON_STREAM = frozenset({DATA, HEADERS, PRIORITY, RST_STREAM, PUSH_PROMISE, CONTINUATION})
_ON_CONNECTION = frozenset({SETTINGS, PING, GOAWAY})
_PLAIN_HEADERS = END_HEADERS | PADDED | PRIORITY_FLAG  # a whole block, nothing to strip
_IDLE_KINDS = frozenset({PING, SETTINGS, PRIORITY})
_NEUTRAL_KINDS = frozenset({WINDOW_UPDATE, RST_STREAM})

DataHandler = Callable[[int, int, bytes, int], None]
"""Takes a DATA frame: (flags, stream id, payload without padding, flow-controlled length)."""
FrameHandler = Callable[[int, int, int, bytes, int], None]
"""Takes any other frame: (type, flags, stream id, payload, length). HEADERS' payload is the
whole header block, CONTINUATIONs joined, without padding or priority, flagged END_HEADERS;
CONTINUATION frames are not handed over."""


class H2ProtocolError(Exception):
    """A connection error (RFC 9113 §5.4.1): answered with GOAWAY `code`."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class FrameReader:
    """Frames out of a byte stream, checked, handed in order to `on_data` (DATA) and `on_frame`
    (the rest) by `feed(data)`, which keeps a partial frame for the next call. The peer's first
    frame must be SETTINGS, after the client's connection preface with `preface` (the server
    side; RFC 9113 §3.4)."""

    __slots__ = ("_block", "_idle", "_partial", "_plain", "_preface", "_settings_seen",
                 "max_frame", "max_header_block", "max_idle_frames", "on_data", "on_frame")

    def __init__(self, on_data: DataHandler, on_frame: FrameHandler, *, max_header_block: int,
                 max_frame: int = MAX_FRAME, max_idle_frames: int = MAX_IDLE_FRAMES,
                 preface: bool = False) -> None:
        self.on_data, self.on_frame = on_data, on_frame
        self.max_frame = max_frame
        self.max_idle_frames = max_idle_frames
        self._idle = 0  # frames in a row that carried nothing
        self.max_header_block = max_header_block
        self._preface = preface
        self._settings_seen = False
        self._partial = Pieces()  # an incomplete frame (or preface)
        # An unfinished header block: (stream id, first frame's flags, fragments, size).
        self._block: tuple[int, int, list[bytes], int] | None = None
        self._plain = False  # SETTINGS seen, no header block open: the short way is safe

    def feed(self, data: bytes) -> None:
        """Hand over each whole frame in `data` (after what came before); raises
        `H2ProtocolError` at the first broken rule, after handing over the frames before it."""
        partial = self._partial
        buffer = partial.add(data) if partial.have else data
        if buffer is None:
            return
        offset = 0
        if self._preface:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(buffer):
                    raise H2ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                partial.keep(buffer, len(PREFACE))
                return
            if not buffer.startswith(PREFACE):
                raise H2ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self._preface = False
            offset = len(PREFACE)
        size = len(buffer)
        need = 9  # what completes the frame left over, if one is
        max_frame, on_data = self.max_frame, self.on_data
        while size - offset >= 9:
            high, low, kind, flags, stream_id = FRAME_HEADER.unpack_from(buffer, offset)
            length = high << 8 | low
            if length > max_frame:
                raise H2ProtocolError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
            end = offset + 9 + length
            if end > size:
                need = 9 + length
                break
            stream_id &= 0x7FFFFFFF
            payload = buffer[offset + 9:end]
            offset = end
            if kind == DATA and stream_id and self._plain:  # most frames: the short way
                if length or flags & END_STREAM:
                    self._idle = 0
                else:
                    self._count_idle()
                on_data(flags, stream_id, payload if not flags & PADDED else _unpad(payload, 1),
                        length)
            elif (kind == HEADERS and flags & _PLAIN_HEADERS == END_HEADERS and stream_id
                  and self._plain and length <= self.max_header_block):
                self._idle = 0
                self.on_frame(kind, flags, stream_id, payload, length)
            else:
                checked = self._check(kind, flags, stream_id, payload)
                if checked is None:
                    continue
                kind, flags, payload = checked
                if kind in _IDLE_KINDS or kind > CONTINUATION:
                    if not (flags & ACK and (kind == PING or kind == SETTINGS)):
                        self._count_idle()
                elif kind == DATA and not length and not flags & END_STREAM:
                    self._count_idle()
                elif kind not in _NEUTRAL_KINDS:
                    self._idle = 0
                if kind == DATA:
                    on_data(flags, stream_id, payload, length)
                else:
                    self.on_frame(kind, flags, stream_id, payload, length)
        if offset < size:
            partial.keep(buffer[offset:], need)

    def _count_idle(self) -> None:
        self._idle += 1
        if self._idle > self.max_idle_frames:
            raise H2ProtocolError(ENHANCE_YOUR_CALM, "a flood of frames that carry nothing")

    def _check(self, kind: int, flags: int, stream_id: int,
               payload: bytes) -> tuple[int, int, bytes] | None:
        """(type, flags, payload) to hand over; None for a CONTINUATION not ending its block."""
        block = self._block
        if block is not None and (kind != CONTINUATION or stream_id != block[0]):
            raise H2ProtocolError(PROTOCOL_ERROR, "expected CONTINUATION")
        if not self._settings_seen:
            if kind != SETTINGS or flags & ACK:
                raise H2ProtocolError(PROTOCOL_ERROR, "the preface must be followed by SETTINGS")
            self._settings_seen = self._plain = True
        size = len(payload)
        fixed = _FIXED_LENGTH.get(kind)
        if fixed is not None and size != fixed:
            raise H2ProtocolError(FRAME_SIZE_ERROR, f"frame type {kind} of {size} bytes")
        if kind == SETTINGS and (size % 6 or (flags & ACK and size)):
            raise H2ProtocolError(FRAME_SIZE_ERROR, "SETTINGS not in whole entries")
        if kind == GOAWAY and size < 8:
            raise H2ProtocolError(FRAME_SIZE_ERROR, "GOAWAY too short")
        if stream_id:
            if kind in _ON_CONNECTION:
                raise H2ProtocolError(PROTOCOL_ERROR, f"frame type {kind} on a stream")
        elif kind in _ON_STREAM:
            raise H2ProtocolError(PROTOCOL_ERROR, f"frame type {kind} on stream 0")
        if kind == HEADERS:
            if flags & PADDED:
                payload = _unpad(payload, 6 if flags & PRIORITY_FLAG else 1)
            elif flags & PRIORITY_FLAG and size < 5:
                raise H2ProtocolError(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            self._check_block_size(len(payload))
            if flags & END_HEADERS:
                return kind, flags, payload
            self._block = (stream_id, flags, [payload], len(payload))
            self._plain = False
            return None
        if kind == CONTINUATION:
            if block is None:
                raise H2ProtocolError(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            fragments = block[2]
            fragments.append(payload)
            total = block[3] + size
            self._check_block_size(total)
            if not flags & END_HEADERS:
                self._block = (stream_id, block[1], fragments, total)
                return None
            self._block = None
            self._plain = True
            return HEADERS, block[1] | END_HEADERS, b"".join(fragments)
        if kind == DATA and flags & PADDED:
            payload = _unpad(payload, 1)
        elif kind == PUSH_PROMISE:
            raise H2ProtocolError(PROTOCOL_ERROR, "PUSH_PROMISE, though push is disabled")
        return kind, flags, payload

    def _check_block_size(self, size: int) -> None:
        if size > self.max_header_block:
            raise H2ProtocolError(ENHANCE_YOUR_CALM,
                                  f"header block over {self.max_header_block} bytes")


def _unpad(payload: bytes, reserved: int) -> bytes:
    """The payload without its padding: a pad length byte, `reserved - 1` more leading bytes
    (HEADERS' priority) left in place, the padding cut off."""
    size = len(payload)
    if size < reserved or payload[0] > size - reserved:
        raise H2ProtocolError(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1:size - payload[0]]


def settings_entries(payload: bytes) -> list[tuple[int, int]]:
    """A SETTINGS frame's (identifier, value) pairs, each value checked (RFC 9113 §6.5.2)."""
    entries = []
    for offset in range(0, len(payload) - 5, 6):
        key, value = _SETTING.unpack_from(payload, offset)
        if key == SETTINGS_ENABLE_PUSH and value > 1:
            raise H2ProtocolError(PROTOCOL_ERROR, "bad SETTINGS_ENABLE_PUSH")
        if key == SETTINGS_INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
            raise H2ProtocolError(FLOW_CONTROL_ERROR, "bad SETTINGS_INITIAL_WINDOW_SIZE")
        if key == SETTINGS_MAX_FRAME_SIZE and not DEFAULT_MAX_FRAME <= value < 1 << 24:
            raise H2ProtocolError(PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
        entries.append((key, value))
    return entries


def settings_payload(entries: dict[int, int]) -> bytes:
    return b"".join(_SETTING.pack(key, value) for key, value in entries.items())


_CACHED_BLOCKS = 64
_CACHED_BLOCK = 4096  # bytes: Envoy's and grpc's blocks are far smaller; big ones would pin memory


class HeaderDecoder:
    """HPACK decoding (RFC 7541) to a dict (a repeated name keeps its last value), with the
    decoded header list capped at `max_header_list` bytes (RFC 9113's size: name + value + 32
    per field); `decode()` raises `H2ProtocolError`: COMPRESSION_ERROR for a bad block,
    ENHANCE_YOUR_CALM for one over the cap. A peer sends the same blocks again and again
    (Envoy's ext_proc request headers, a server's response headers and trailers): a block whose
    decoding left the dynamic table unchanged decodes the same while the table stays so, and its
    result is reused (hpack costs ≈ 2 µs per field); at most 64 blocks of up to 4 KiB are kept.
    Values are `value_encoding`."""

    __slots__ = ("_cache", "_decoder", "_value_encoding")

    def __init__(self, max_header_list: int, value_encoding: str = "latin-1") -> None:
        self._decoder = Decoder(max_header_list_size=max_header_list)
        self._value_encoding = value_encoding
        self._cache: dict[bytes, tuple[object, int, int, dict[str, str]]] = {}

    def decode(self, block: bytes) -> dict[str, str]:
        """The block's fields, names as sent; the dict is shared with later calls for the same
        block: do not change it."""
        table = self._decoder.header_table
        dynamic = table.dynamic_entries
        newest, length, maxsize = (dynamic[0] if dynamic else None), len(dynamic), table.maxsize
        cached = self._cache.get(block)
        if (cached is not None and cached[0] is newest and cached[1] == length
                and cached[2] == maxsize):
            return cached[3]
        try:  # always decoded otherwise, to keep the HPACK state in step
            fields = self._decoder.decode(block, raw=True)
        except OversizedHeaderListError as exc:
            raise H2ProtocolError(ENHANCE_YOUR_CALM, f"header list over "
                                  f"{self._decoder.max_header_list_size} bytes") from exc
        except (HPACKError, ValueError, IndexError) as exc:
            raise H2ProtocolError(COMPRESSION_ERROR, f"HPACK: {exc}") from exc
        encoding = self._value_encoding
        headers = {bytes(k).decode("latin-1"): bytes(v).decode(encoding, "replace")
                   for k, v in fields}
        # Any insertion makes a new newest entry, any eviction a shorter table, a size update
        # a new maxsize: unchanged means the block may be reused.
        if ((dynamic[0] if dynamic else None) is newest and len(dynamic) == length
                and table.maxsize == maxsize and len(block) <= _CACHED_BLOCK):
            if len(self._cache) >= _CACHED_BLOCKS:
                self._cache.clear()
            self._cache[block] = (newest, length, maxsize, headers)
        return headers


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    size = len(payload)
    return FRAME_HEADER.pack(size >> 8, size & 0xFF, kind, flags, stream_id) + payload


SETTINGS_ACK = frame(SETTINGS, ACK, 0)
LAST_POSSIBLE_STREAM = 0x7FFFFFFF
_GOAWAY_DEBUG = 256  # bytes of the reason a GOAWAY carries


def goaway_frame(last_stream_id: int, code: int, reason: str = "") -> bytes:
    """GOAWAY naming the last stream the sender took, its error code and (debug data) the first
    bytes of `reason`."""
    debug = reason.encode("utf-8", "replace")[:_GOAWAY_DEBUG]
    return frame(GOAWAY, 0, 0, U32.pack(last_stream_id) + U32.pack(code) + debug)


def goaway_fields(payload: bytes) -> tuple[int, int]:
    """A GOAWAY's (last stream id, error code); `FrameReader` checked its length."""
    return U32.unpack_from(payload)[0] & 0x7FFFFFFF, U32.unpack_from(payload, 4)[0]


def ping_ack(payload: bytes) -> bytes:
    """The answer to a PING: an ACK with the same 8 bytes."""
    return frame(PING, ACK, 0, payload)


def header_frames(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> list[bytes]:
    """A header block as HEADERS and as many CONTINUATIONs as `max_frame` (the peer's) needs."""
    flags = END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return [frame(HEADERS, flags | END_HEADERS, stream_id, block)]
    out = [frame(HEADERS, flags, stream_id, block[:max_frame])]
    for start in range(max_frame, len(block), max_frame):
        last = start + max_frame >= len(block)
        out.append(frame(CONTINUATION, END_HEADERS if last else 0, stream_id,
                         block[start:start + max_frame]))
    return out


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
