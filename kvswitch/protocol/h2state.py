"""The connection-level HTTP/2 state both of kvswitch's transports keep (RFC 9113 §6.5, §6.9);
no I/O. Used by the EPP's server (`kvswitch.epp.h2connection`) and the gRPC client
(`kvswitch.protocol.h2client_core`).

`ConnectionState` holds what the peer's SETTINGS said (initial stream window, frame size,
stream limit) and the connection's flow-control windows both ways. Inbound, the window is
opened to 2^31-1 at once and topped up once `refill_at` bytes were used; DATA beyond it is a
FLOW_CONTROL_ERROR. Outbound, the window grows with the peer's WINDOW_UPDATEs (0 is a
PROTOCOL_ERROR, past 2^31-1 a FLOW_CONTROL_ERROR). Methods return the frames to write; errors
raise `H2ProtocolError`. Per-stream windows are `kvswitch.protocol.h2streams.StreamFlow`.

`FrameInput` is what both connections do with bytes read: the frame reader's handlers append
events to `_events` for the read under way; a broken rule, or any other error (a bug must cost
this connection only, not the process), becomes `_fail(code, reason)` instead of an exception;
after a read without error the connection window is topped up when due.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

from kvswitch.protocol.http2 import (
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    FLOW_CONTROL_ERROR,
    INTERNAL_ERROR,
    MAX_FRAME,
    MAX_WINDOW,
    PROTOCOL_ERROR,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    U32,
    WINDOW_UPDATE,
    FrameReader,
    H2ProtocolError,
    frame,
    settings_entries,
    settings_payload,
)

__all__ = ["NO_EVENTS", "REFILL_AT", "ConnectionState", "FrameInput"]

logger = logging.getLogger(__name__)

REFILL_AT = 1 << 30
"""Inbound bytes after which the connection window is topped up (half of 2^31-1: one
WINDOW_UPDATE per GiB, and the peer never runs dry)."""


class ConnectionState:
    """One connection's SETTINGS and connection-level windows."""

    __slots__ = ("peer_initial_window", "peer_max_frame", "peer_max_streams", "recv_unacked",
                 "recv_window", "refill_at", "send_window")

    def __init__(self, refill_at: int = REFILL_AT) -> None:
        self.refill_at = refill_at
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_MAX_FRAME
        self.peer_max_streams = 2**31
        self.send_window = DEFAULT_WINDOW
        self.recv_window = DEFAULT_WINDOW
        self.recv_unacked = 0

    def initiate(self, *, initial_window: int, max_header_list: int,
                 max_concurrent_streams: int | None = None) -> bytes:
        """Our SETTINGS (push disabled, frames up to `MAX_FRAME`, the stream window, the header
        list cap and, from a server, the stream limit), and the connection window opened to
        2^31-1."""
        self.recv_window = MAX_WINDOW
        settings = {SETTINGS_ENABLE_PUSH: 0}
        if max_concurrent_streams is not None:
            settings[SETTINGS_MAX_CONCURRENT_STREAMS] = max_concurrent_streams
        settings[SETTINGS_INITIAL_WINDOW_SIZE] = initial_window
        settings[SETTINGS_MAX_FRAME_SIZE] = MAX_FRAME
        settings[SETTINGS_MAX_HEADER_LIST_SIZE] = max_header_list
        return (frame(SETTINGS, 0, 0, settings_payload(settings))
                + frame(WINDOW_UPDATE, 0, 0, U32.pack(MAX_WINDOW - DEFAULT_WINDOW)))

    def on_settings(self, payload: bytes) -> int:
        """Apply the peer's SETTINGS (not an ACK; the caller answers with `SETTINGS_ACK`); returns
        how much its initial stream window changed, for the open streams' send windows."""
        delta = 0
        for key, value in settings_entries(payload):
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                delta += value - self.peer_initial_window
                self.peer_initial_window = value
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self.peer_max_frame = value
            elif key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
        return delta

    def on_window_update(self, payload: bytes) -> None:
        """A WINDOW_UPDATE on stream 0."""
        increment = U32.unpack(payload)[0] & 0x7FFFFFFF
        if not increment:
            raise H2ProtocolError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        self.send_window += increment
        if self.send_window > MAX_WINDOW:
            raise H2ProtocolError(FLOW_CONTROL_ERROR, "connection window over 2^31-1")

    def received(self, length: int) -> None:
        """A DATA frame's flow-controlled length arrived."""
        self.recv_window -= length
        if self.recv_window < 0:
            raise H2ProtocolError(FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self.recv_unacked += length

    def refill(self) -> bytes:
        """The WINDOW_UPDATE that tops the connection window up, once due; else b""."""
        unacked = self.recv_unacked
        if unacked < self.refill_at:
            return b""
        self.recv_window += unacked
        self.recv_unacked = 0
        return frame(WINDOW_UPDATE, 0, 0, U32.pack(unacked))


E = TypeVar("E")

NO_EVENTS: list[Any] = []
"""`_events` between reads; never appended to: frames are handled only inside a read."""


class FrameInput(Generic[E]):
    """The input side of a connection: `_read(data) -> [event]` (see the module docstring);
    the subclass builds `_reader`, `_connection` and `_out`, and implements `_fail`."""

    _reader: FrameReader
    _connection: ConnectionState
    _out: list[bytes]
    _events: list[E]  # what the read under way returns

    def _read(self, data: bytes) -> list[E]:
        events: list[E] = []
        self._events = events
        try:
            self._reader.feed(data)
            self._read_done()
        except H2ProtocolError as exc:
            self._fail(exc.code, exc.reason)
            return events
        except Exception as exc:  # a bug must cost this connection only, not the process
            logger.exception("HTTP/2 connection failed")
            self._fail(INTERNAL_ERROR, f"internal error: {exc}")
            return events
        finally:
            self._events = NO_EVENTS  # the caller's now: not kept past this call
        connection = self._connection
        if connection.recv_unacked >= connection.refill_at:
            self._out.append(connection.refill())
        return events

    def _read_done(self) -> None:
        """After the frames of a read were handed over (still inside its guard)."""

    def _fail(self, code: int, reason: str) -> None:
        """A connection error: GOAWAY `code`, the events that end the connection."""
        raise NotImplementedError
