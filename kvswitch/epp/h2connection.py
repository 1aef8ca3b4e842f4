"""The sans-IO core of the EPP's lean gRPC-over-HTTP/2 server (h2c, prior knowledge).

`H2GrpcConnection`: `receive(bytes) -> [event]`, `send_message()`, `finish()`, `reset()`,
`drain()` / `goaway()`, `data_to_send() -> bytes`. Frames are read, checked and HPACK-decoded
by the shared frame layer (`kvswitch.protocol.http2`), windows kept by the shared flow control
(`kvswitch.protocol.h2state`, `kvswitch.protocol.h2streams`: inbound large windows topped up as
data arrives, outbound data waiting per stream for WINDOW_UPDATE) and messages cut by the
shared gRPC framing (`kvswitch.protocol.grpc_framing`; compressed messages are refused: no
encoding is negotiated); this keeps the server's stream states. A stream opened past
`max_concurrent_streams` (advertised in SETTINGS) is refused with RST_STREAM REFUSED_STREAM.
Malformed input is a connection error: GOAWAY with the error code, then `closed`. Floods are
too: more than `MAX_IDLE_FRAMES` frames in a row that cost work but carry nothing (counted by
the frame layer) end the connection with ENHANCE_YOUR_CALM; the header list is bounded
(`MAX_HEADER_LIST`, advertised).
`kvswitch.epp.h2server` drives it.

Scope, on purpose: unary and bidi calls, no compression, no server push, no priorities,
grpc-timeout ignored (Envoy's message_timeout governs). Responses are encoded as literals without
indexing, so encoding touches no HPACK state.
"""

from __future__ import annotations

import logging
import struct

from kvswitch.epp.h2events import (
    ConnectionEnded,
    Event,
    InputEnded,
    MessageReceived,
    StreamOpened,
    StreamReset,
)
from kvswitch.errors import PayloadTooLarge
from kvswitch.protocol.grpc_framing import (
    INTERNAL,
    NOT_FOUND,
    OK,
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    FrameDecoder,
    encode,
    trailers_block,
)
from kvswitch.protocol.h2state import NO_EVENTS, ConnectionState, FrameInput
from kvswitch.protocol.h2streams import StreamFlow
from kvswitch.protocol.http2 import (
    ACK,
    CANCEL,
    DATA,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    LAST_POSSIBLE_STREAM,
    MAX_IDLE_FRAMES,
    NO_ERROR,
    PING,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ACK,
    STREAM_CLOSED,
    U32,
    WINDOW_UPDATE,
    FrameReader,
    H2ProtocolError,
    HeaderDecoder,
    frame,
    goaway_frame,
    header_frames,
    hpack_literal,
    ping_ack,
)

__all__ = [
    "INTERNAL", "MAX_CONCURRENT_STREAMS", "MAX_IDLE_FRAMES", "NOT_FOUND", "OK",
    "RESOURCE_EXHAUSTED", "UNIMPLEMENTED", "ConnectionEnded", "Event",
    "H2GrpcConnection", "InputEnded", "MessageReceived", "StreamOpened", "StreamReset",
]

logger = logging.getLogger(__name__)

MAX_HEADER_LIST = 1 << 20
"""A header block's bytes (HEADERS + CONTINUATION) and its decoded header list, advertised as
SETTINGS_MAX_HEADER_LIST_SIZE."""
_STREAM_WINDOW = 4 << 20
# Streams one client may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS). Envoy multiplexes
# a worker's ext_proc streams over one connection, each open while flow control queues its
# request, so the limit must sit above any backlog worth queuing. 4096 is what kvswitch's Envoy
# bootstrap sets for the EPP cluster: Envoy opens another connection at the lower of the two.
MAX_CONCURRENT_STREAMS = 4096


# A DATA frame's header followed by an uncompressed gRPC message's 5-byte prefix.
_DATA_MESSAGE = struct.Struct(">HBBBIBI")

# ":status: 200" is static-table entry 8 (indexed: one byte).
_RESPONSE_HEADERS = b"\x88" + hpack_literal("content-type", "application/grpc")
_DRAIN_PING = b"kvsdrain"  # the opaque data of the PING that follows a draining GOAWAY


class _Stream(StreamFlow):
    __slots__ = ("decoder", "headers_sent", "local_done", "remote_done")

    def __init__(self, stream_id: int, send_window: int, recv_window: int) -> None:
        super().__init__(stream_id, send_window, recv_window, recv_window // 2)
        self.decoder: FrameDecoder | None = None  # made once a message spans frames
        self.headers_sent = False
        self.remote_done = False  # the client sent END_STREAM
        self.local_done = False  # trailers queued or sent


def check_stream_limit(limit: int) -> None:
    """SETTINGS_MAX_CONCURRENT_STREAMS is a 32-bit value; 0 would refuse every stream."""
    if not 0 < limit < 1 << 32:
        raise ValueError(f"max_concurrent_streams {limit} is not in 1..2^32-1")


class H2GrpcConnection(FrameInput[Event]):
    """The server side of one HTTP/2 connection carrying gRPC calls; no I/O."""

    def __init__(self, *, max_message_bytes: int = 4 << 20, stream_window: int = _STREAM_WINDOW,
                 max_concurrent_streams: int = MAX_CONCURRENT_STREAMS) -> None:
        check_stream_limit(max_concurrent_streams)
        self.max_concurrent_streams = max_concurrent_streams
        self.max_message_bytes = max_message_bytes
        self.stream_window = stream_window
        self.streams: dict[int, _Stream] = {}
        self.closed = False
        self.highest_stream_id = 0
        self.goaway_sent = False  # the final GOAWAY: streams past `highest_stream_id` are refused
        # New streams are refused once this many are open: the advertised limit, 0 after the
        # final GOAWAY (one compare per new stream covers both).
        self._open_limit = max_concurrent_streams
        self.draining = False  # `drain()` was called: the final GOAWAY follows the PING's ACK
        self.peer_goaway = False
        self._out: list[bytes] = []
        self._reader = FrameReader(self._on_data, self._on_frame,
                                   max_header_block=MAX_HEADER_LIST, preface=True)
        self._decoder = HeaderDecoder(MAX_HEADER_LIST)
        self._connection = ConnectionState()
        self._blocked: dict[int, _Stream] = {}
        self._events: list[Event] = NO_EVENTS

    def initiate(self) -> None:
        """Queue our SETTINGS (no push, the stream limit, big stream window and frames) and open
        the connection window."""
        self._out.append(self._connection.initiate(
            initial_window=self.stream_window, max_header_list=MAX_HEADER_LIST,
            max_concurrent_streams=self.max_concurrent_streams))

    def data_to_send(self) -> bytes:
        out, self._out = self._out, []
        return b"".join(out) if len(out) != 1 else out[0]

    # -- input -------------------------------------------------------------------------------

    def receive(self, data: bytes) -> list[Event]:
        """Feed bytes read from the socket; never raises (bad input ends the connection)."""
        return [] if self.closed else self._read(data)

    def _fail(self, code: int, reason: str) -> None:
        logger.warning("HTTP/2 connection error %#x: %s", code, reason)
        self.goaway(code, reason)
        self.closed = True
        self._events.append(ConnectionEnded(code, reason))

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes,
                  length: int) -> None:
        """A frame other than DATA, as `FrameReader` checked it (header blocks whole)."""
        events = self._events
        if kind == HEADERS:
            if not stream_id & 1:
                raise H2ProtocolError(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
            self._header_block_done(stream_id, flags, payload, events)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload, events)
        elif kind == RST_STREAM:
            self._check_not_idle(stream_id, "RST_STREAM")
            if self._drop(stream_id):
                events.append(StreamReset(stream_id, U32.unpack(payload)[0]))
        elif kind == SETTINGS:
            self._on_settings(flags, payload)
        elif kind == PING:
            if not flags & ACK:
                self._out.append(ping_ack(payload))
            elif payload == _DRAIN_PING and self.draining and not self.goaway_sent:
                self.goaway()  # the peer has seen the first GOAWAY: name the real last stream
        elif kind == GOAWAY:
            self.peer_goaway = True  # no new streams from the peer; open ones carry on
        # PRIORITY and unknown frame types are ignored (RFC 9113 §5.3.2, §4.1).

    def _check_not_idle(self, stream_id: int, what: str) -> None:
        if not stream_id or stream_id > self.highest_stream_id:
            raise H2ProtocolError(PROTOCOL_ERROR, f"{what} on idle stream {stream_id}")

    def _on_settings(self, flags: int, payload: bytes) -> None:
        if flags & ACK:
            return
        delta = self._connection.on_settings(payload)
        if delta:
            for stream in self.streams.values():
                stream.send_window += delta
        self._out.append(SETTINGS_ACK)
        self._flush_blocked()

    def _on_window_update(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        increment = U32.unpack(payload)[0] & 0x7FFFFFFF
        if not stream_id:
            self._connection.on_window_update(payload)
            self._flush_blocked()
            return
        self._check_not_idle(stream_id, "WINDOW_UPDATE")
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        error = stream.window_update(increment)
        if error:
            self._stream_error(stream, error, events)
        elif stream.pending:
            self._flush(stream)

    def _on_data(self, flags: int, stream_id: int, payload: bytes, length: int) -> None:
        events = self._events
        self._connection.received(length)
        stream = self.streams.get(stream_id)
        if stream is None:
            self._check_not_idle(stream_id, "DATA")
            return  # a stream we closed already: discard
        if stream.remote_done:
            self._stream_error(stream, STREAM_CLOSED, events)
            return
        if not stream.received(length):
            self._stream_error(stream, FLOW_CONTROL_ERROR, events)
            return
        if payload:
            size = len(payload)
            decoder = stream.decoder
            if ((decoder is None or not decoder.pending) and size >= 5 and not payload[0]
                    and U32.unpack_from(payload, 1)[0] == size - 5
                    and size - 5 <= self.max_message_bytes):
                # The usual frame: exactly one whole uncompressed message.
                events.append(MessageReceived(stream_id, payload[5:]))
            else:
                self._messages(stream, payload, events)
                if stream.id not in self.streams:
                    return
        if flags & END_STREAM:
            self._remote_ended(stream, events)
            return
        update = stream.consumed(length)
        if update:
            self._out.append(update)

    def _messages(self, stream: _Stream, data: bytes, events: list[Event]) -> None:
        decoder = stream.decoder
        if decoder is None:
            decoder = stream.decoder = FrameDecoder(max_message_bytes=self.max_message_bytes)
        messages: list[bytes] = []
        try:
            decoder.feed_into(data, messages)
        except PayloadTooLarge as exc:
            error: tuple[int, str] | None = (RESOURCE_EXHAUSTED, exc.message)
        except Exception as exc:  # noqa: BLE001 - InvalidRequest: a bad flag, no encoding
            error = (INTERNAL, str(exc))
        else:
            error = None
        events.extend([MessageReceived(stream.id, message) for message in messages])
        if error is not None:
            self._refuse(stream, *error, events)

    def _remote_ended(self, stream: _Stream, events: list[Event]) -> None:
        stream.remote_done = True
        if stream.decoder is not None and stream.decoder.pending:
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

    def _header_block_done(self, stream_id: int, flags: int, block: bytes,
                           events: list[Event]) -> None:
        headers = dict(self._decoder.decode(block))
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
        if len(self.streams) >= self._open_limit:
            # Over SETTINGS_MAX_CONCURRENT_STREAMS (RFC 9113 §5.1.2; from the start, not only
            # once the peer ACKs it: a refused stream is safe to retry, §8.7), or after the
            # final GOAWAY. Decoded above, so HPACK stays in step; other streams carry on.
            self._out.append(frame(RST_STREAM, 0, stream_id, U32.pack(REFUSED_STREAM)))
            return
        stream = self.streams[stream_id] = _Stream(stream_id, self._connection.peer_initial_window,
                                                           self.stream_window)
        path = headers.get(":path")
        if headers.get(":method") != "POST" or not path:
            self._stream_error(stream, PROTOCOL_ERROR, events)  # not a gRPC request
            return
        events.append(StreamOpened(stream_id, path, headers))
        if flags & END_STREAM:
            self._remote_ended(stream, events)

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
        size = 5 + len(message)
        connection = self._connection
        if (not stream.pending and size <= stream.send_window and size <= connection.send_window
                and size <= connection.peer_max_frame):
            stream.send_window -= size
            connection.send_window -= size
            # The frame header and the gRPC prefix in one pack: one copy of the message.
            self._out.append(_DATA_MESSAGE.pack(size >> 8, size & 0xFF, DATA, 0, stream_id, 0,
                                                size - 5) + message)
        else:
            stream.pending.append(encode(message))
            self._flush(stream)
        return True

    def finish(self, stream_id: int, status: int = OK, message: str = "") -> None:
        """End the call with trailers (trailers-only if nothing was sent), after queued data."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_done:
            return
        stream.local_done = True
        block = trailers_block(status, message)
        if not stream.headers_sent:
            stream.headers_sent = True
            block = _RESPONSE_HEADERS + block
        if stream.pending:
            stream.pending.append((block,))
            self._flush(stream)
        else:
            self._send_trailers(stream, block)

    def _send_trailers(self, stream: _Stream, block: bytes) -> None:
        self._out.extend(header_frames(stream.id, block, True,
                                      self._connection.peer_max_frame))
        if stream.remote_done:
            del self.streams[stream.id]
        else:  # the client may still be sending: tell it to stop (as gRPC servers do)
            self.reset(stream.id, NO_ERROR)

    def _flush(self, stream: _Stream) -> None:
        trailers = stream.write_pending(self._connection, self._out)
        if trailers is not None:
            self._blocked.pop(stream.id, None)
            self._send_trailers(stream, trailers)
        elif stream.pending:
            self._blocked[stream.id] = stream
        else:
            self._blocked.pop(stream.id, None)

    def _flush_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._connection.send_window <= 0:
                return
            if stream.id in self.streams:
                self._flush(stream)
            else:
                self._blocked.pop(stream.id, None)

    def reset(self, stream_id: int, code: int = CANCEL) -> None:
        """RST_STREAM `code`; the stream is forgotten."""
        self._out.append(frame(RST_STREAM, 0, stream_id, U32.pack(code)))
        self._drop(stream_id)

    def _drop(self, stream_id: int) -> bool:
        self._blocked.pop(stream_id, None)
        return self.streams.pop(stream_id, None) is not None

    def drain(self) -> None:
        """Start a graceful shutdown as grpc-go and nghttp2 do: a GOAWAY naming the highest
        stream id possible stops the peer opening streams yet refuses none it has sent already,
        then a PING; its ACK proves the peer saw the GOAWAY, and the final `goaway()` (sent
        then, or by the driver if no ACK comes) names the real last stream. A single GOAWAY
        would refuse the streams crossing it on the wire, and Envoy does not retry those."""
        if self.draining or self.goaway_sent:
            return
        self.draining = True
        self._out.append(goaway_frame(LAST_POSSIBLE_STREAM, NO_ERROR))
        self._out.append(frame(PING, 0, 0, _DRAIN_PING))

    def goaway(self, code: int = NO_ERROR, reason: str = "") -> None:
        """No new streams past the highest seen; open ones may finish (NO_ERROR)."""
        self.goaway_sent = True
        self._open_limit = 0
        self._out.append(goaway_frame(self.highest_stream_id, code, reason))

