"""The events the EPP's HTTP/2 server core (`kvswitch.epp.h2connection.H2GrpcConnection`) hands
its driver: a call opened, a message, the client's half-close, a reset, the connection's end.
Made per frame and read once, so plain (not frozen: a frozen dataclass costs per field).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

__all__ = ["ConnectionEnded", "Event", "InputEnded", "MessageReceived", "StreamOpened",
           "StreamReset"]



@dataclass(slots=True)
class StreamOpened:
    """A request's headers arrived on a new stream."""

    stream_id: int
    path: str
    """`:path`, e.g. /envoy.service.ext_proc.v3.ExternalProcessor/Process."""
    headers: dict[str, str]
    """Every header field, pseudo-headers included, lowercase names."""


@dataclass(slots=True)
class MessageReceived:
    """One whole gRPC message (without its 5-byte prefix) on an open stream."""

    stream_id: int
    message: bytes


@dataclass(slots=True)
class InputEnded:
    """The client half-closed the stream: no more messages will come on it."""

    stream_id: int


@dataclass(slots=True)
class StreamReset:
    """The stream ended abnormally (RST_STREAM from the peer, or a stream error here)."""

    stream_id: int
    error_code: int


@dataclass(slots=True)
class ConnectionEnded:
    """A connection error: GOAWAY sent, every open stream is gone, nothing more is read."""

    error_code: int
    reason: str


Event: TypeAlias = StreamOpened | MessageReceived | InputEnded | StreamReset | ConnectionEnded
