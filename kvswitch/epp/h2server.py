"""A lean gRPC server over HTTP/2 (h2c, prior knowledge): just what Envoy needs from the EPP.

Why not grpc.aio: its floor is ≈ 0.6 ms of CPU per ext_proc stream on this machine (a
completion-queue thread handing each message to the event loop, a batch op and a future per
read and write; benchmarks/epp_request_path.py), several times the EPP's own work per request.

Two layers, h2-style:
- `H2GrpcConnection` is the sans-IO core: `receive(bytes) -> [event]`, `send_message()`,
  `finish()`, `reset()`, `goaway()`, `data_to_send() -> bytes`. It parses and writes frames,
  keeps per-stream state, does HTTP/2 flow control both ways (inbound: large windows, topped up
  as data arrives; outbound: data waits per stream for WINDOW_UPDATE), and gRPC message
  framing (5-byte prefix; compressed messages are refused: no encoding is negotiated).
  Malformed input is a connection error: GOAWAY with the error code, then `closed`.
- `H2GrpcServer` runs it: one `asyncio.Protocol` per connection dispatching events to a
  `StreamHandler` per stream, chosen by `:path` from the server's `handlers` (unknown path:
  grpc-status 12 UNIMPLEMENTED). Shutdown sends GOAWAY and lets open streams finish up to the
  grace period, then closes the connections (handlers see `on_reset`).

Scope, on purpose: unary and bidi calls, no compression, no server push, no priorities,
grpc-timeout ignored (Envoy's message_timeout governs). HPACK decoding is `hpack`; responses are
encoded as literals without indexing, so encoding touches no HPACK state.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeAlias
from urllib.parse import quote

from hpack import Decoder, HPACKError

__all__ = [
    "Call", "ConnectionEnded", "H2GrpcConnection", "H2GrpcServer", "InputEnded",
    "MessageReceived", "StreamHandler", "StreamOpened", "StreamReset",
]

logger = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
# gRPC status codes used here.
OK, NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 5, 8, 12, 13

_U32 = struct.Struct(">I")
_MAX_WINDOW = 2**31 - 1
_DEFAULT_WINDOW = 65535
_MAX_FRAME = 1 << 20  # what we accept; Envoy sends up to this once told
_STREAM_WINDOW = 4 << 20
_REFILL_CONNECTION_AT = 1 << 30


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    return _U32.pack(len(payload))[1:] + bytes((kind, flags)) + _U32.pack(stream_id) + payload


def _hpack_int(value: int, bits: int, flags: int = 0) -> bytes:
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


def _literal(name: str, value: str) -> bytes:
    """A header as "literal without indexing, new name", no Huffman (RFC 7541 §6.2.2)."""
    raw_name, raw_value = name.encode("latin-1"), value.encode("latin-1", "replace")
    return (b"\x00" + _hpack_int(len(raw_name), 7) + raw_name
            + _hpack_int(len(raw_value), 7) + raw_value)


# ":status: 200" is static-table entry 8 (indexed: one byte).
_RESPONSE_HEADERS = b"\x88" + _literal("content-type", "application/grpc")
_OK_TRAILERS = _literal("grpc-status", "0")


def _trailers(status: int, message: str) -> bytes:
    if status == OK and not message:
        return _OK_TRAILERS
    block = _literal("grpc-status", str(status))
    if message:  # percent-encoded as gRPC requires (printable ASCII except '%' stays)
        block += _literal("grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"))
    return block


# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamOpened:
    """A request's headers arrived on a new stream."""

    stream_id: int
    path: str
    """`:path`, e.g. /envoy.service.ext_proc.v3.ExternalProcessor/Process."""
    headers: dict[str, str]
    """Every header field, pseudo-headers included, lowercase names."""


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """One whole gRPC message (without its 5-byte prefix) on an open stream."""

    stream_id: int
    message: bytes


@dataclass(frozen=True, slots=True)
class InputEnded:
    """The client half-closed the stream: no more messages will come on it."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamReset:
    """The stream ended abnormally (RST_STREAM from the peer, or a stream error here)."""

    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class ConnectionEnded:
    """A connection error: GOAWAY sent, every open stream is gone, nothing more is read."""

    error_code: int
    reason: str


Event: TypeAlias = StreamOpened | MessageReceived | InputEnded | StreamReset | ConnectionEnded


class H2ConnectionError(Exception):
    """A connection error (RFC 9113 §5.4.1): answered with GOAWAY `code`."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class _Stream:
    __slots__ = ("have", "headers_sent", "id", "local_done", "need", "partial", "pending",
                 "recv_unacked", "recv_window", "remote_done", "send_window")

    def __init__(self, stream_id: int, send_window: int, recv_window: int) -> None:
        self.id = stream_id
        # A partial gRPC message as received (joined once whole: big messages arrive in many
        # frames), its size so far and the size that completes it (or its 5-byte prefix).
        self.partial: list[bytes] = []
        self.have = self.need = 0
        self.headers_sent = False
        self.remote_done = False  # the client sent END_STREAM
        self.local_done = False  # trailers queued or sent
        self.pending: deque[bytes | tuple[bytes]] = deque()  # DATA waiting for window; (trailers,)
        self.send_window = send_window
        self.recv_window = recv_window
        self.recv_unacked = 0


class H2GrpcConnection:
    """The server side of one HTTP/2 connection carrying gRPC calls; no I/O."""

    def __init__(self, *, max_message_bytes: int = 4 << 20,
                 stream_window: int = _STREAM_WINDOW) -> None:
        self.max_message_bytes = max_message_bytes
        self.stream_window = stream_window
        self.streams: dict[int, _Stream] = {}
        self.closed = False
        self.highest_stream_id = 0
        self.goaway_sent = False
        self.peer_goaway = False
        self._out: list[bytes] = []
        self._partial: list[bytes] = []  # an incomplete frame, joined once whole (as above)
        self._have = self._need = 0
        self._preface = False
        self._settings_seen = False
        self._decoder = Decoder()
        self._decoded: dict[bytes, tuple[object, int, dict[str, str]]] = {}
        self._header_block: tuple[int, int, bytearray] | None = None
        self._send_window = _DEFAULT_WINDOW
        self._peer_initial_window = _DEFAULT_WINDOW
        self._peer_max_frame = 16384
        self._recv_window = _DEFAULT_WINDOW
        self._recv_unacked = 0
        self._blocked: dict[int, _Stream] = {}

    def initiate(self) -> None:
        """Queue our SETTINGS (big stream window and frames) and open the connection window."""
        settings = struct.pack(">HIHIHI", 0x2, 0, 0x4, self.stream_window, 0x5, _MAX_FRAME)
        self._out.append(frame(SETTINGS, 0, 0, settings))
        self._out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(_MAX_WINDOW - _DEFAULT_WINDOW)))
        self._recv_window = _MAX_WINDOW

    def data_to_send(self) -> bytes:
        out, self._out = self._out, []
        return b"".join(out) if len(out) != 1 else out[0]

    # -- input -------------------------------------------------------------------------------

    def receive(self, data: bytes) -> list[Event]:
        """Feed bytes read from the socket; never raises (bad input ends the connection)."""
        if self.closed:
            return []
        events: list[Event] = []
        if self._partial:
            self._partial.append(data)
            self._have += len(data)
            if self._have < self._need:
                return events
            buffer = b"".join(self._partial)
            self._partial, self._have = [], 0
        else:
            buffer = data
        offset = 0
        try:
            if not self._preface:
                if len(buffer) < len(PREFACE):
                    if not PREFACE.startswith(buffer):
                        raise H2ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    self._partial, self._have, self._need = [buffer], len(buffer), len(PREFACE)
                    return events
                if not buffer.startswith(PREFACE):
                    raise H2ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self._preface = True
                offset = len(PREFACE)
            size = len(buffer)
            self._need = 9
            while size - offset >= 9:
                length = _U32.unpack_from(buffer, offset)[0] >> 8
                if length > _MAX_FRAME:
                    raise H2ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                end = offset + 9 + length
                if end > size:
                    self._need = 9 + length
                    break
                kind, flags = buffer[offset + 3], buffer[offset + 4]
                stream_id = _U32.unpack_from(buffer, offset + 5)[0] & 0x7FFFFFFF
                payload = buffer[offset + 9:end]
                offset = end
                self._on_frame(kind, flags, stream_id, payload, events)
                if self.closed:
                    return events
            if offset < size:
                self._partial, self._have = [buffer[offset:]], size - offset
        except H2ConnectionError as exc:
            self._fail(exc.code, exc.reason, events)
        except Exception as exc:  # a parsing bug must cost this connection, not the server
            logger.exception("HTTP/2 connection failed")
            self._fail(INTERNAL_ERROR, f"internal error: {exc}", events)
        if self._recv_unacked >= _REFILL_CONNECTION_AT:
            self._out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_unacked)))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0
        return events

    def _fail(self, code: int, reason: str, events: list[Event]) -> None:
        logger.warning("HTTP/2 connection error %#x: %s", code, reason)
        self.goaway(code, reason.encode("utf-8", "replace")[:256])
        self.closed = True
        events.append(ConnectionEnded(code, reason))

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes,
                  events: list[Event]) -> None:
        if self._header_block is not None and (
                kind != CONTINUATION or stream_id != self._header_block[0]):
            raise H2ConnectionError(PROTOCOL_ERROR, "expected CONTINUATION")
        if not self._settings_seen:
            if kind != SETTINGS or flags & ACK:
                raise H2ConnectionError(PROTOCOL_ERROR, "the preface must be followed by SETTINGS")
            self._settings_seen = True
        if kind == DATA:
            self._on_data(flags, stream_id, payload, events)
        elif kind == HEADERS or kind == CONTINUATION:
            self._on_headers(kind, flags, stream_id, payload, events)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload, events)
        elif kind == RST_STREAM:
            if len(payload) != 4:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "RST_STREAM of the wrong size")
            self._check_not_idle(stream_id, "RST_STREAM")
            if self._drop(stream_id):
                events.append(StreamReset(stream_id, _U32.unpack(payload)[0]))
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == PING:
            if stream_id:
                raise H2ConnectionError(PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "PING of the wrong size")
            if not flags & ACK:
                self._out.append(frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            if stream_id or len(payload) < 8:
                raise H2ConnectionError(PROTOCOL_ERROR, "malformed GOAWAY")
            self.peer_goaway = True  # no new streams from the peer; open ones carry on
        elif kind == PRIORITY:
            if not stream_id:
                raise H2ConnectionError(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "PRIORITY of the wrong size")
        elif kind == PUSH_PROMISE:
            raise H2ConnectionError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # Unknown frame types are ignored (RFC 9113 §4.1).

    def _check_not_idle(self, stream_id: int, what: str) -> None:
        if not stream_id or stream_id > self.highest_stream_id:
            raise H2ConnectionError(PROTOCOL_ERROR, f"{what} on idle stream {stream_id}")

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise H2ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == 0x2 and value > 1:
                raise H2ConnectionError(PROTOCOL_ERROR, "bad SETTINGS_ENABLE_PUSH")
            if key == 0x4:
                if value > _MAX_WINDOW:
                    raise H2ConnectionError(FLOW_CONTROL_ERROR, "bad SETTINGS_INITIAL_WINDOW_SIZE")
                delta, self._peer_initial_window = value - self._peer_initial_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == 0x5:
                if not 16384 <= value < 1 << 24:
                    raise H2ConnectionError(PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
                self._peer_max_frame = value
        self._out.append(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _on_window_update(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if not stream_id:
            if not increment:
                raise H2ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > _MAX_WINDOW:
                raise H2ConnectionError(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            self._flush_blocked()
            return
        self._check_not_idle(stream_id, "WINDOW_UPDATE")
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        stream.send_window += increment
        if not increment or stream.send_window > _MAX_WINDOW:
            self._stream_error(stream, PROTOCOL_ERROR if not increment else FLOW_CONTROL_ERROR,
                               events)
        elif stream.pending:
            self._flush(stream)

    def _on_data(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if not stream_id:
            raise H2ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        self._recv_window -= length
        if self._recv_window < 0:
            raise H2ConnectionError(FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._recv_unacked += length
        if flags & PADDED:
            payload = _unpad(payload)
        stream = self.streams.get(stream_id)
        if stream is None:
            self._check_not_idle(stream_id, "DATA")
            return  # a stream we closed already: discard
        if stream.remote_done:
            self._stream_error(stream, STREAM_CLOSED, events)
            return
        stream.recv_window -= length
        if stream.recv_window < 0:
            self._stream_error(stream, FLOW_CONTROL_ERROR, events)
            return
        if payload:
            self._messages(stream, payload, events)
            if stream.id not in self.streams:
                return
        if flags & END_STREAM:
            self._remote_ended(stream, events)
            return
        stream.recv_unacked += length
        if stream.recv_unacked >= self.stream_window // 2:
            self._out.append(frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(stream.recv_unacked)))
            stream.recv_window += stream.recv_unacked
            stream.recv_unacked = 0

    def _messages(self, stream: _Stream, data: bytes, events: list[Event]) -> None:
        if stream.partial:
            stream.partial.append(data)
            stream.have += len(data)
            if stream.have < stream.need:
                return
            buffer = b"".join(stream.partial)
            stream.partial, stream.have = [], 0
        else:
            buffer = data
        offset, size = 0, len(buffer)
        while size - offset >= 5:
            length = _U32.unpack_from(buffer, offset + 1)[0]
            if buffer[offset]:
                self._refuse(stream, INTERNAL, "compressed message without negotiated encoding",
                             events)
                return
            if length > self.max_message_bytes:
                self._refuse(stream, RESOURCE_EXHAUSTED,
                             f"message of {length} bytes over the {self.max_message_bytes} limit",
                             events)
                return
            end = offset + 5 + length
            if end > size:
                break
            events.append(MessageReceived(stream.id, buffer[offset + 5:end]))
            offset = end
        if offset < size:
            rest = buffer[offset:]
            stream.partial, stream.have = [rest], len(rest)
            stream.need = 5 + _U32.unpack_from(rest, 1)[0] if len(rest) >= 5 else 5

    def _remote_ended(self, stream: _Stream, events: list[Event]) -> None:
        stream.remote_done = True
        if stream.partial:
            self._refuse(stream, INTERNAL, "stream ended inside a message", events)
        elif stream.local_done and not stream.pending:
            del self.streams[stream.id]
        else:
            events.append(InputEnded(stream.id))

    def _refuse(self, stream: _Stream, status: int, message: str, events: list[Event]) -> None:
        """End a call the server cannot take further: trailers with `status`, then the stream
        is reset for the input side."""
        stream.pending.clear()
        self.finish(stream.id, status, message)
        self._drop(stream.id)
        events.append(StreamReset(stream.id, CANCEL))

    def _stream_error(self, stream: _Stream, code: int, events: list[Event]) -> None:
        self.reset(stream.id, code)
        events.append(StreamReset(stream.id, code))

    def _on_headers(self, kind: int, flags: int, stream_id: int, payload: bytes,
                    events: list[Event]) -> None:
        if kind == HEADERS:
            if not stream_id or not stream_id & 1:
                raise H2ConnectionError(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
            if flags & PADDED:
                payload = _unpad(payload)
            if flags & PRIORITY_FLAG:
                if len(payload) < 5:
                    raise H2ConnectionError(FRAME_SIZE_ERROR, "HEADERS too short for priority")
                payload = payload[5:]
            if flags & END_HEADERS:
                self._header_block_done(stream_id, flags, payload, events)
            else:
                self._header_block = (stream_id, flags, bytearray(payload))
            return
        if self._header_block is None:
            raise H2ConnectionError(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        block = self._header_block[2]
        block += payload
        if len(block) > 1 << 20:
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "header block over 1 MiB")
        if flags & END_HEADERS:
            _, first_flags, _ = self._header_block
            self._header_block = None
            self._header_block_done(stream_id, first_flags, bytes(block), events)

    def _header_block_done(self, stream_id: int, flags: int, block: bytes,
                           events: list[Event]) -> None:
        headers = self._decode(block)
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers
            if not flags & END_STREAM or stream.remote_done:
                self._stream_error(stream, PROTOCOL_ERROR, events)
            else:
                self._remote_ended(stream, events)
            return
        if stream_id <= self.highest_stream_id:
            return  # trailers of a stream we already closed
        self.highest_stream_id = stream_id
        if self.goaway_sent:
            self._out.append(frame(RST_STREAM, 0, stream_id, _U32.pack(REFUSED_STREAM)))
            return
        stream = self.streams[stream_id] = _Stream(stream_id, self._peer_initial_window,
                                                           self.stream_window)
        path = headers.get(":path")
        if headers.get(":method") != "POST" or not path:
            self._stream_error(stream, PROTOCOL_ERROR, events)  # not a gRPC request
            return
        events.append(StreamOpened(stream_id, path, headers))
        if flags & END_STREAM:
            self._remote_ended(stream, events)

    def _decode(self, block: bytes) -> dict[str, str]:
        """The header block as a dict. Envoy opens every ext_proc stream with the same block
        (indexed fields and a literal :path that is not indexed): a block whose decoding left
        the dynamic table as it was decodes the same way while the table stays so, and its
        result is reused (hpack costs ≈ 2 µs per field). Any insertion makes a new newest
        entry, any eviction a shorter table: (newest entry, length) tells the table changed."""
        dynamic = self._decoder.header_table.dynamic_entries
        newest, length = (dynamic[0] if dynamic else None), len(dynamic)
        cached = self._decoded.get(block)
        if cached is not None and cached[0] is newest and cached[1] == length:
            return dict(cached[2])
        try:  # always decoded otherwise, to keep the HPACK state in step
            fields = self._decoder.decode(block, raw=True)
        except (HPACKError, ValueError, IndexError) as exc:
            raise H2ConnectionError(COMPRESSION_ERROR, f"HPACK: {exc}") from exc
        headers = {bytes(k).decode("latin-1"): bytes(v).decode("latin-1") for k, v in fields}
        if (dynamic[0] if dynamic else None) is newest and len(dynamic) == length:
            if len(self._decoded) >= 64:
                self._decoded.clear()
            self._decoded[block] = (newest, length, headers)
            return dict(headers)
        return headers

    # -- output ------------------------------------------------------------------------------

    def send_message(self, stream_id: int, message: bytes) -> bool:
        """Queue one gRPC message (response headers first if not sent); False if the stream
        is gone or finished."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_done:
            return False
        if not stream.headers_sent:
            stream.headers_sent = True
            self._out.append(frame(HEADERS, END_HEADERS, stream_id, _RESPONSE_HEADERS))
        data = b"\x00" + _U32.pack(len(message)) + message
        size = len(data)
        if (not stream.pending and size <= stream.send_window and size <= self._send_window
                and size <= self._peer_max_frame):
            stream.send_window -= size
            self._send_window -= size
            self._out.append(frame(DATA, 0, stream_id, data))
        else:
            stream.pending.append(data)
            self._flush(stream)
        return True

    def finish(self, stream_id: int, status: int = OK, message: str = "") -> None:
        """End the call with trailers (trailers-only if nothing was sent), after queued data."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_done:
            return
        stream.local_done = True
        block = _trailers(status, message)
        if not stream.headers_sent:
            stream.headers_sent = True
            block = _RESPONSE_HEADERS + block
        if stream.pending:
            stream.pending.append((block,))
            self._flush(stream)
        else:
            self._send_trailers(stream, block)

    def _send_trailers(self, stream: _Stream, block: bytes) -> None:
        step = self._peer_max_frame
        if len(block) <= step:
            self._out.append(frame(HEADERS, END_STREAM | END_HEADERS, stream.id, block))
        else:
            self._out.append(frame(HEADERS, END_STREAM, stream.id, block[:step]))
            for start in range(step, len(block), step):
                last = start + step >= len(block)
                self._out.append(frame(CONTINUATION, END_HEADERS if last else 0, stream.id,
                                       block[start:start + step]))
        if stream.remote_done:
            del self.streams[stream.id]
        else:  # the client may still be sending: tell it to stop (as gRPC servers do)
            self.reset(stream.id, NO_ERROR)

    def _flush(self, stream: _Stream) -> None:
        pending = stream.pending
        while pending:
            item = pending[0]
            if type(item) is tuple:
                pending.popleft()
                self._blocked.pop(stream.id, None)
                self._send_trailers(stream, item[0])
                return
            assert isinstance(item, bytes)
            size = min(len(item), stream.send_window, self._send_window, self._peer_max_frame)
            if size <= 0:
                self._blocked[stream.id] = stream
                return
            stream.send_window -= size
            self._send_window -= size
            self._out.append(frame(DATA, 0, stream.id, item[:size]))
            if size == len(item):
                pending.popleft()
            else:
                pending[0] = item[size:]
        self._blocked.pop(stream.id, None)

    def _flush_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._send_window <= 0:
                return
            if stream.id in self.streams:
                self._flush(stream)
            else:
                self._blocked.pop(stream.id, None)

    def reset(self, stream_id: int, code: int = CANCEL) -> None:
        """RST_STREAM `code`; the stream is forgotten."""
        self._out.append(frame(RST_STREAM, 0, stream_id, _U32.pack(code)))
        self._drop(stream_id)

    def _drop(self, stream_id: int) -> bool:
        self._blocked.pop(stream_id, None)
        return self.streams.pop(stream_id, None) is not None

    def goaway(self, code: int = NO_ERROR, debug: bytes = b"") -> None:
        """No new streams past the highest seen; open ones may finish (NO_ERROR)."""
        self.goaway_sent = True
        payload = _U32.pack(self.highest_stream_id) + _U32.pack(code) + debug
        self._out.append(frame(GOAWAY, 0, 0, payload))


def _unpad(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise H2ConnectionError(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1:len(payload) - payload[0]]


# -- asyncio driver ----------------------------------------------------------------------------


class StreamHandler(Protocol):
    """One call's server side; `H2GrpcServer` calls these as the client's frames arrive."""

    def on_message(self, message: bytes) -> None: ...
    def on_end(self) -> None:
        """The client half-closed: finish the call with `Call.finish()`."""
    def on_reset(self) -> None:
        """The call is gone (RST_STREAM, connection lost or closed): nothing can be sent."""


class Call:
    """What a handler may do with its stream: send messages, finish with a status."""

    __slots__ = ("_protocol", "headers", "stream_id")

    def __init__(self, protocol: _Protocol, stream_id: int, headers: dict[str, str]) -> None:
        self._protocol, self.stream_id, self.headers = protocol, stream_id, headers

    def send(self, message: bytes) -> None:
        protocol = self._protocol
        protocol.conn.send_message(self.stream_id, message)
        if not protocol.receiving:
            protocol.flush()

    def finish(self, status: int = OK, message: str = "") -> None:
        protocol = self._protocol
        protocol.conn.finish(self.stream_id, status, message)
        protocol.handlers.pop(self.stream_id, None)
        if not protocol.receiving:
            protocol.flush()
        if protocol.server.closing:
            protocol.server.connection_gone()


HandlerFactory: TypeAlias = Callable[[Call], StreamHandler]


class _Protocol(asyncio.Protocol):
    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.conn = H2GrpcConnection(max_message_bytes=server.max_message_bytes)
        self.handlers: dict[int, StreamHandler] = {}
        self.transport: asyncio.Transport | None = None
        self.receiving = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self.conn.initiate()
        if self.server.closing:
            self.conn.goaway()
        self.flush()

    def data_received(self, data: bytes) -> None:
        self.receiving = True
        for event in self.conn.receive(data):
            try:
                self._dispatch(event)
            except Exception:  # a handler bug costs its stream, not the connection's others
                logger.exception("stream handler failed")
                stream_id = getattr(event, "stream_id", 0)
                if stream_id:
                    self.conn.reset(stream_id, INTERNAL_ERROR)
                    self.handlers.pop(stream_id, None)
        self.receiving = False
        self.flush()
        if self.conn.closed and self.transport is not None:
            self.transport.close()
        if self.server.closing:  # a WINDOW_UPDATE may have let a finished stream's data out
            self.server.connection_gone()

    def _dispatch(self, event: Event) -> None:
        kind = type(event)
        if kind is MessageReceived:
            handler = self.handlers.get(event.stream_id)  # type: ignore[union-attr]
            if handler is not None:
                handler.on_message(event.message)  # type: ignore[union-attr]
        elif kind is StreamOpened:
            self._open(event)  # type: ignore[arg-type]
        elif kind is InputEnded:
            handler = self.handlers.get(event.stream_id)  # type: ignore[union-attr]
            if handler is not None:
                handler.on_end()
        elif kind is StreamReset:
            handler = self.handlers.pop(event.stream_id, None)  # type: ignore[union-attr]
            if handler is not None:
                handler.on_reset()
            if self.server.closing:
                self.server.connection_gone()
        elif kind is ConnectionEnded:
            self._reset_all()

    def _open(self, event: StreamOpened) -> None:
        factory = self.server.handlers.get(event.path)
        if factory is None:
            self.conn.finish(event.stream_id, UNIMPLEMENTED, f"unknown method {event.path}")
            return
        content_type = event.headers.get("content-type", "")
        encoding = event.headers.get("grpc-encoding", "identity")
        if not content_type.startswith("application/grpc"):
            self.conn.finish(event.stream_id, INTERNAL, f"content-type {content_type!r}")
            return
        if encoding != "identity":
            self.conn.finish(event.stream_id, UNIMPLEMENTED, f"grpc-encoding {encoding!r}")
            return
        self.handlers[event.stream_id] = factory(Call(self, event.stream_id, event.headers))

    def _reset_all(self) -> None:
        handlers, self.handlers = self.handlers, {}
        for handler in handlers.values():
            try:
                handler.on_reset()
            except Exception:
                logger.exception("stream handler failed on reset")

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.closed = True
        self.transport = None
        self.server.connections.discard(self)
        self._reset_all()
        self.server.connection_gone()

    def idle(self) -> bool:
        return not self.handlers and not self.conn.streams


class H2GrpcServer:
    """Serves `handlers` (`:path` -> factory of a `StreamHandler` per call) over h2c."""

    def __init__(self, handlers: Mapping[str, HandlerFactory], *, host: str = "127.0.0.1",
                 port: int = 0, max_message_bytes: int = 4 << 20) -> None:
        self.handlers = dict(handlers)
        self.host, self.port = host, port
        self.max_message_bytes = max_message_bytes
        self.connections: set[_Protocol] = set()
        self.closing = False
        self._server: asyncio.AbstractServer | None = None
        self._stopped = asyncio.Event()
        self._drained: asyncio.Event | None = None

    async def start(self) -> int:
        """Bind and listen; returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Protocol(self), self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        """Stop listening, GOAWAY every connection, let open calls finish for `grace` s, then
        close what is left (its handlers see `on_reset`)."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for protocol in list(self.connections):
            protocol.conn.goaway()
            protocol.flush()
        self._drained = asyncio.Event()
        self.connection_gone()
        try:
            await asyncio.wait_for(self._drained.wait(), grace)
        except TimeoutError:
            pass
        for protocol in list(self.connections):
            if protocol.transport is not None:
                protocol.transport.close()
            protocol.connection_lost(None)
        self._stopped.set()

    def connection_gone(self) -> None:
        """Called as calls and connections end; completes a shutdown drain."""
        if self._drained is not None and all(p.idle() for p in self.connections):
            self._drained.set()

    async def wait(self) -> None:
        await self._stopped.wait()
