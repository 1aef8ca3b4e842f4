"""Per-stream HTTP/2 flow control (RFC 9113 §5.2, §6.9), shared by the EPP's server and the gRPC
client; no I/O.

`StreamFlow` is one stream's windows both ways; each side's stream class extends it. Inbound:
`received(length)` counts a DATA frame against the window (False: the peer overran it, a
FLOW_CONTROL_ERROR for the stream); `consumed(length)` returns the WINDOW_UPDATE that gives the
bytes back once `refill_at` of them have been consumed; `arrived(length)` is both at once. Outbound:
`window_update()` grows the window; `pending` holds DATA (bytes) and, last, the trailers (a 1-tuple
of a header block) that wait for window, and `write_pending()` writes as much as the stream's and
the connection's windows and the peer's frame size allow.
"""

from __future__ import annotations

from collections import deque

from kvswitch.protocol.h2state import ConnectionState
from kvswitch.protocol.http2 import (
    DATA,
    FLOW_CONTROL_ERROR,
    MAX_WINDOW,
    PROTOCOL_ERROR,
    U32,
    WINDOW_UPDATE,
    frame,
)

__all__ = ["StreamFlow"]


class StreamFlow:
    """One stream's flow-control windows and the data waiting for them."""

    __slots__ = ("id", "pending", "recv_unacked", "recv_window", "refill_at", "send_window")

    def __init__(self, stream_id: int, send_window: int, recv_window: int,
                 refill_at: int) -> None:
        self.id = stream_id
        self.send_window = send_window
        self.recv_window = recv_window
        self.refill_at = refill_at
        self.recv_unacked = 0
        self.pending: deque[bytes | tuple[bytes]] = deque()

    def received(self, length: int) -> bool:
        """Count a DATA frame's flow-controlled length; False if it overran the window."""
        self.recv_window -= length
        return self.recv_window >= 0

    def consumed(self, length: int) -> bytes:
        """The WINDOW_UPDATE giving back what was consumed, once `refill_at` bytes are; else b""."""
        unacked = self.recv_unacked + length
        if unacked < self.refill_at:
            self.recv_unacked = unacked
            return b""
        self.recv_window += unacked
        self.recv_unacked = 0
        return frame(WINDOW_UPDATE, 0, self.id, U32.pack(unacked))

    def arrived(self, length: int) -> bytes | None:
        """`received()` then `consumed()`, for a side that consumes DATA as it arrives: None if
        the peer overran the window, else the WINDOW_UPDATE due (or b"")."""
        window = self.recv_window - length
        if window < 0:
            self.recv_window = window
            return None
        unacked = self.recv_unacked + length
        if unacked < self.refill_at:
            self.recv_window, self.recv_unacked = window, unacked
            return b""
        self.recv_window, self.recv_unacked = window + unacked, 0
        return frame(WINDOW_UPDATE, 0, self.id, U32.pack(unacked))

    def window_update(self, increment: int) -> int:
        """Apply the peer's WINDOW_UPDATE; returns 0, or the stream error's code (an increment of
        0, or a window past 2^31-1)."""
        self.send_window += increment
        if not increment:
            return PROTOCOL_ERROR
        return FLOW_CONTROL_ERROR if self.send_window > MAX_WINDOW else 0

    def write_pending(self, connection: ConnectionState, out: list[bytes]) -> bytes | None:
        """Append to `out` the DATA frames the windows allow; returns the trailers' block once
        everything before them is out (taken off `pending`), else None (`pending` says whether
        data still waits)."""
        pending = self.pending
        while pending:
            item = pending[0]
            if type(item) is tuple:
                pending.popleft()
                return item[0]
            assert isinstance(item, bytes)
            size = min(len(item), self.send_window, connection.send_window,
                       connection.peer_max_frame)
            if size <= 0:
                return None
            self.send_window -= size
            connection.send_window -= size
            out.append(frame(DATA, 0, self.id, item[:size]))
            if size == len(item):
                pending.popleft()
            else:
                pending[0] = item[size:]
        return None
