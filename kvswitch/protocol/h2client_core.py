"""The sans-IO client side of an HTTP/2 connection carrying gRPC calls (h2c or TLS); no I/O.

`H2ClientConnection`: `initiate()`, `start_call()` (request headers and its one message),
`receive(bytes) -> [event]`, `reset()`, `ping()`, `lost()`, `data_to_send() -> bytes`.
`kvswitch.protocol.h2client` drives it from asyncio. Frames, HPACK, SETTINGS and connection
windows are the shared core (`kvswitch.protocol.http2`, `h2state`), stream windows
`h2streams.StreamFlow`, messages and status `grpc_framing`. Received DATA without flags is
gathered per stream and cut into messages once per `receive()` (one `MessagesReceived` per
stream and read). A broken rule of RFC 9113 (the frame layer's, or a frame on a stream we never
opened) is a connection error: GOAWAY with its code, every open call ends UNAVAILABLE, then
`ConnectionEnded` and nothing more is read. A response message over `max_response_message`
ends its call RESOURCE_EXHAUSTED, a compressed one INTERNAL (no encoding is negotiated); both
reset the stream. Request bodies are sent whole: a call the windows cannot take is not started.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from kvswitch.errors import PayloadTooLarge
from kvswitch.protocol.grpc_framing import (
    INTERNAL,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    FrameDecoder,
    call_status,
    encode,
    http_status_code,
)
from kvswitch.protocol.h2state import NO_EVENTS, REFILL_AT, ConnectionState, FrameInput
from kvswitch.protocol.h2streams import StreamFlow
from kvswitch.protocol.http2 import (
    ACK,
    CANCEL,
    DATA,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ACK,
    U32,
    WINDOW_UPDATE,
    FrameReader,
    H2ProtocolError,
    HeaderDecoder,
    frame,
    goaway_fields,
    goaway_frame,
    header_frames,
    hpack_literal,
    ping_ack,
)

__all__ = ["MAX_HEADER_BLOCK", "MAX_RESPONSE_MESSAGE", "CallEnded", "ClientEvent",
           "ConnectionEnded", "GoAwayReceived", "H2ClientConnection", "MessagesReceived",
           "PingAcked", "timeout_header"]

MAX_HEADER_BLOCK = 256 * 1024
"""Largest header block (HEADERS + CONTINUATION) and decoded header list read before the
connection is dropped; advertised as SETTINGS_MAX_HEADER_LIST_SIZE."""
MAX_RESPONSE_MESSAGE = 64 * 1024 * 1024
"""Largest response message a call takes (what the frontend's grpc.aio fallback allows); a
longer one announced fails the call with RESOURCE_EXHAUSTED before its bytes are kept."""
# gRPC status of a call the server reset, by HTTP/2 error code (gRPC's PROTOCOL-HTTP2.md).
_RST_STATUS = {REFUSED_STREAM: UNAVAILABLE, CANCEL: 1, 0xB: RESOURCE_EXHAUSTED}


@dataclass(slots=True)
class MessagesReceived:
    """The whole gRPC messages (without prefixes) received for a call in one `receive()`."""

    stream_id: int
    messages: list[bytes]


@dataclass(slots=True)
class CallEnded:
    """A call is over: `status` 0 (OK) from its trailers, or why it failed."""

    stream_id: int
    status: int
    details: str


@dataclass(slots=True)
class PingAcked:
    """The peer answered one of our PINGs."""

    payload: bytes


@dataclass(slots=True)
class GoAwayReceived:
    """The server sent GOAWAY: no new calls here; those past `last_stream_id` ended already."""

    last_stream_id: int
    error_code: int


@dataclass(slots=True)
class ConnectionEnded:
    """A connection error: our GOAWAY is queued, every call ended, nothing more is read."""

    error_code: int
    reason: str


ClientEvent: TypeAlias = MessagesReceived | CallEnded | PingAcked | GoAwayReceived | ConnectionEnded


def timeout_header(seconds: float) -> str:
    """A deadline as gRPC's `grpc-timeout` value: at most 8 digits and a unit, rounded up."""
    millis = max(1, math.ceil(seconds * 1000))
    return f"{millis}m" if millis < 10**8 else f"{min(math.ceil(seconds), 10**8 - 1)}S"


class _Call(StreamFlow):
    __slots__ = ("decoder", "headers_seen")

    def __init__(self, stream_id: int, send_window: int, max_message: int) -> None:
        super().__init__(stream_id, send_window, MAX_WINDOW, REFILL_AT)
        self.decoder = FrameDecoder(max_message_bytes=max_message)
        self.headers_seen = False


class H2ClientConnection(FrameInput[ClientEvent]):
    """The client side of one HTTP/2 connection carrying gRPC calls; no I/O."""

    def __init__(self, authority: str, *, scheme: str = "http",
                 user_agent: str = "kvswitch-frontend",
                 max_response_message: int = MAX_RESPONSE_MESSAGE) -> None:
        if scheme not in ("http", "https"):
            raise ValueError(f"scheme {scheme!r} is not http or https")
        self.authority, self.scheme, self.user_agent = authority, scheme, user_agent
        self.max_response_message = max_response_message
        self.calls: dict[int, _Call] = {}
        self.closed = False
        """No new calls here: GOAWAY came or went, or the connection failed or was lost."""
        self.failed = False  # a connection error: nothing more is read
        self._next_id = 1
        self._out: list[bytes] = []
        self._events: list[ClientEvent] = NO_EVENTS
        self._reader = FrameReader(self._on_data, self._on_frame,
                                   max_header_block=MAX_HEADER_BLOCK)
        # Plain DATA frames gathered per stream, cut into messages once per read.
        self._gathered: dict[int, list[bytes]] = {}
        self._decoder = HeaderDecoder(MAX_HEADER_BLOCK, "utf-8")
        self._fixed_headers: dict[tuple[str, float | None], bytes] = {}
        self._connection = ConnectionState(REFILL_AT)

    def initiate(self) -> None:
        """Queue the preface, our SETTINGS (no push, big windows and frames, the header list
        cap) and the connection window opened."""
        self._out.append(PREFACE + self._connection.initiate(
            initial_window=MAX_WINDOW, max_header_list=MAX_HEADER_BLOCK))

    def data_to_send(self) -> bytes:
        out = self._out
        if not out:
            return b""
        self._out = []
        return b"".join(out) if len(out) != 1 else out[0]

    # -- output ------------------------------------------------------------------------------

    def start_call(self, path: str, metadata: Sequence[tuple[str, str]], body: bytes,
                   timeout: float | None = None) -> int | None:
        """Queue a call's request (headers, `metadata` pairs, one message, END_STREAM); its
        stream id, or None when this connection cannot take it now (closed, out of stream ids
        or slots, or the body over the windows)."""
        size = len(body) + 5
        connection = self._connection
        if (self.closed or self._next_id >= 2**31 or len(self.calls) >= connection.peer_max_streams
                or size > min(connection.send_window, connection.peer_initial_window)):
            return None
        stream_id, self._next_id = self._next_id, self._next_id + 2
        fixed = self._fixed_headers.get((path, timeout))
        if fixed is None:
            headers = [(":method", "POST"), (":scheme", self.scheme), (":path", path),
                       (":authority", self.authority), ("content-type", "application/grpc"),
                       ("te", "trailers"), ("user-agent", self.user_agent)]
            if timeout is not None:
                headers.append(("grpc-timeout", timeout_header(timeout)))
            fixed = b"".join(hpack_literal(k, v) for k, v in headers)
            if len(self._fixed_headers) >= 64:  # callers with ever-changing deadlines
                self._fixed_headers.clear()
            self._fixed_headers[(path, timeout)] = fixed
        block = fixed + b"".join([hpack_literal(k, v) for k, v in metadata])
        self.calls[stream_id] = _Call(stream_id, connection.peer_initial_window - size,
                                      self.max_response_message)
        connection.send_window -= size
        message = encode(body)
        step = connection.peer_max_frame
        out = self._out
        out.extend(header_frames(stream_id, block, False, step))
        for start in range(0, len(message), step):
            last = start + step >= len(message)
            out.append(frame(DATA, END_STREAM if last else 0, stream_id,
                             message[start:start + step]))
        return stream_id

    def reset(self, stream_id: int, code: int = CANCEL) -> None:
        """End a call here (cancelled, past its deadline, a bad message): RST_STREAM `code`."""
        if self.calls.pop(stream_id, None) is not None and not self.failed:
            self._out.append(frame(RST_STREAM, 0, stream_id, U32.pack(code)))

    def ping(self, payload: bytes) -> None:
        """Queue a PING with 8 bytes of `payload`; its ACK comes back as `PingAcked`."""
        if not self.failed:
            self._out.append(frame(PING, 0, 0, payload))

    def lost(self, reason: str) -> list[ClientEvent]:
        """The transport is gone (or given up on): every open call ends UNAVAILABLE."""
        self.closed = self.failed = True
        calls, self.calls = self.calls, {}
        return [CallEnded(stream_id, UNAVAILABLE, reason) for stream_id in calls]

    # -- input -------------------------------------------------------------------------------

    def receive(self, data: bytes) -> list[ClientEvent]:
        """Feed bytes read from the transport; never raises (bad input ends the connection)."""
        return [] if self.failed else self._read(data)

    def _read_done(self) -> None:
        if self._gathered:
            self._deliver()

    def _fail(self, code: int, reason: str) -> None:
        if self._gathered:  # what arrived before the broken frame still counts
            try:
                self._deliver()
            except H2ProtocolError:
                pass  # over the window too: the connection fails all the same
        self._out.append(goaway_frame(0, code, reason))
        events = self._events
        events.extend(self.lost(f"connection to {self.authority} failed: {reason}"))
        events.append(ConnectionEnded(code, reason))

    def _deliver(self) -> None:
        """Cut the gathered DATA into messages, counted against the windows (once per stream
        and read, not per frame: the same checks, fewer calls)."""
        gathered, self._gathered = self._gathered, {}
        calls, received = self.calls, self._connection.received
        for stream_id, parts in gathered.items():
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            received(len(data))
            call = calls.get(stream_id)
            if call is not None:
                self._call_data(call, data, len(data))

    def _call_data(self, call: _Call, data: bytes, length: int) -> None:
        update = call.arrived(length)
        if update is None:
            self._end(call, INTERNAL, "response over the stream's window", FLOW_CONTROL_ERROR)
            return
        if update:
            self._out.append(update)
        if not data:
            return
        messages: list[bytes] = []
        error = None
        try:
            call.decoder.feed_into(data, messages)
        except PayloadTooLarge as exc:
            error = (RESOURCE_EXHAUSTED, f"response {exc.message}")
        except Exception as exc:  # noqa: BLE001 - InvalidRequest: a bad flag, no encoding
            error = (INTERNAL, f"bad response message: {exc}")
        if messages:
            self._events.append(MessagesReceived(call.id, messages))
        if error is not None:
            self._end(call, *error, CANCEL)

    def _end(self, call: _Call, status: int, details: str, reset: int | None = None) -> None:
        self._events.append(CallEnded(call.id, status, details))
        if reset is None:
            self.calls.pop(call.id, None)
        else:
            self.reset(call.id, reset)

    def _check_opened(self, stream_id: int, kind: str) -> None:
        if stream_id >= self._next_id or not stream_id & 1:
            raise H2ProtocolError(PROTOCOL_ERROR, f"{kind} on stream {stream_id}, never opened")

    def _on_data(self, flags: int, stream_id: int, payload: bytes, length: int) -> None:
        if not flags:
            parts = self._gathered.get(stream_id)
            if parts is None:
                if stream_id >= self._next_id or not stream_id & 1:
                    self._check_opened(stream_id, "DATA")
                self._gathered[stream_id] = [payload]
            else:
                parts.append(payload)
            return
        if self._gathered:  # in order: what came before this frame first
            self._deliver()
        self._check_opened(stream_id, "DATA")
        self._connection.received(length)
        call = self.calls.get(stream_id)
        if call is None:
            return
        self._call_data(call, payload, length)
        if flags & END_STREAM and stream_id in self.calls:
            self._end(call, INTERNAL, "stream ended without trailers")

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes,
                  length: int) -> None:
        if self._gathered:  # in order: what came before this frame first
            self._deliver()
        if kind == HEADERS:
            self._check_opened(stream_id, "HEADERS")
            fields = self._decoder.decode(payload)  # always, to keep HPACK state in step
            call = self.calls.get(stream_id)
            if call is not None:
                self._headers(call, fields, bool(flags & END_STREAM))
        elif kind == SETTINGS and not flags & ACK:
            self._connection.on_settings(payload)  # only future calls: ours send at once
            self._out.append(SETTINGS_ACK)
        elif kind == PING:
            if flags & ACK:
                self._events.append(PingAcked(payload))
            else:
                self._out.append(ping_ack(payload))
        elif kind == WINDOW_UPDATE:
            if not stream_id:
                self._connection.on_window_update(payload)
                return
            self._check_opened(stream_id, "WINDOW_UPDATE")
            call = self.calls.get(stream_id)
            if call is not None:
                error = call.window_update(U32.unpack(payload)[0] & 0x7FFFFFFF)
                if error:
                    self._end(call, INTERNAL, f"bad WINDOW_UPDATE (HTTP/2 error {error})", error)
        elif kind == RST_STREAM:
            self._check_opened(stream_id, "RST_STREAM")
            call = self.calls.get(stream_id)
            if call is not None:
                code = U32.unpack(payload)[0]
                self._end(call, _RST_STATUS.get(code, INTERNAL),
                          f"stream reset by the server (HTTP/2 error {code})")
        elif kind == GOAWAY:
            last, code = goaway_fields(payload)
            self.closed = True  # no new calls here; those the server never saw fail now
            for sid, call in list(self.calls.items()):
                if sid > last:
                    self._end(call, UNAVAILABLE, "connection closing (GOAWAY)")
            self._events.append(GoAwayReceived(last, code))
        # PRIORITY and unknown frame types are ignored (RFC 9113 §5.3.2, §4.1).

    def _headers(self, call: _Call, fields: dict[str, str], end_stream: bool) -> None:
        if not call.headers_seen and not end_stream:
            call.headers_seen = True
            status = fields.get(":status", "200")
            if status != "200":
                self._end(call, http_status_code(status), f"HTTP status {status}")
            return
        if call.decoder.pending:
            self._end(call, INTERNAL, "trailers inside a response message", CANCEL)
            return
        self._end(call, *call_status(fields), None if end_stream else CANCEL)
