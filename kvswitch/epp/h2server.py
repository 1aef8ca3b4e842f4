"""A lean gRPC server over HTTP/2 (h2c, prior knowledge): just what Envoy needs from the EPP.

Why not grpc.aio: its CPU floor per ext_proc stream (a completion-queue thread handing each
message to the event loop, a batch op and a future per read and write) is several times the
EPP's own work per request (docs/benchmarks/transports.md).

Two layers, h2-style:
- `kvswitch.epp.h2connection.H2GrpcConnection` is the sans-IO core (frames, streams, flow
  control, gRPC message framing).
- `H2GrpcServer` here runs it: one `asyncio.Protocol` per connection dispatching events to a
  `StreamHandler` per stream, chosen by `:path` from the server's `handlers` (unknown path:
  grpc-status 12 UNIMPLEMENTED). Shutdown drains each connection in two GOAWAYs (the first
  refuses nothing, the final one follows the peer's PING ACK, or a second without one), lets
  open streams finish up to the grace period, then closes the connections (handlers see
  `on_reset`).

Scope, on purpose: unary and bidi calls, no compression, no server push, no priorities,
grpc-timeout ignored (Envoy's message_timeout governs). HPACK decoding is `hpack`; responses are
encoded as literals without indexing, so encoding touches no HPACK state.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
from collections.abc import Callable, Mapping
from typing import Protocol, TypeAlias

from kvswitch.epp.h2connection import (
    INTERNAL,
    MAX_CONCURRENT_STREAMS,
    NOT_FOUND,
    OK,
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    ConnectionEnded,
    Event,
    H2GrpcConnection,
    InputEnded,
    MessageReceived,
    StreamOpened,
    StreamReset,
    check_stream_limit,
)
from kvswitch.protocol.http2 import INTERNAL_ERROR

__all__ = ["INTERNAL", "NOT_FOUND", "OK", "RESOURCE_EXHAUSTED", "UNIMPLEMENTED", "Call",
           "H2GrpcServer", "HandlerFactory", "StreamHandler"]

logger = logging.getLogger(__name__)

_PING_ACK_WAIT = 1.0  # seconds a draining connection waits for its PING ACK at most


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
            protocol.server.check_drained()


HandlerFactory: TypeAlias = Callable[[Call], StreamHandler]


class _Protocol(asyncio.Protocol):
    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.conn = H2GrpcConnection(max_message_bytes=server.max_message_bytes,
                                     max_concurrent_streams=server.max_concurrent_streams)
        self.handlers: dict[int, StreamHandler] = {}
        self.transport: asyncio.Transport | None = None
        self.receiving = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self.conn.initiate()
        if self.server.closing:
            self.conn.drain()
        self.flush()

    def pause_writing(self) -> None:
        # The peer is not reading what we write (replies, PING and SETTINGS ACKs): stop reading
        # what it sends until it does, so its frames cannot pile our answers up in memory.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.receiving = True
        for event in self.conn.receive(data):
            try:
                if type(event) is MessageReceived:  # most events: handled without a call
                    handler = self.handlers.get(event.stream_id)
                    if handler is not None:
                        handler.on_message(event.message)
                else:
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
            self.server.check_drained()

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
                self.server.check_drained()
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
        self.server.check_drained()

    def idle(self) -> bool:
        """Drained: the final GOAWAY is out (no stream can still arrive) and no call is open."""
        return self.conn.goaway_sent and not self.handlers and not self.conn.streams


class H2GrpcServer:
    """Serves `handlers` (`:path` -> factory of a `StreamHandler` per call) over h2c; each
    connection takes up to `max_concurrent_streams` calls at once and refuses more
    (RST_STREAM REFUSED_STREAM)."""

    def __init__(self, handlers: Mapping[str, HandlerFactory], *, host: str = "127.0.0.1",
                 port: int = 0, max_message_bytes: int = 4 << 20,
                 max_concurrent_streams: int = MAX_CONCURRENT_STREAMS,
                 ssl: ssl_module.SSLContext | None = None,
                 ssl_handshake_timeout: float | None = None) -> None:
        check_stream_limit(max_concurrent_streams)  # here, not at the first connection
        self.ssl = ssl
        """TLS (ALPN h2) instead of h2c when set."""
        self.ssl_handshake_timeout = ssl_handshake_timeout
        """TLS: seconds a client gets to finish its handshake (None: asyncio's 60)."""
        self.handlers = dict(handlers)
        self.host, self.port = host, port
        self.max_message_bytes = max_message_bytes
        self.max_concurrent_streams = max_concurrent_streams
        self.connections: set[_Protocol] = set()
        self.closing = False
        self._server: asyncio.AbstractServer | None = None
        self._stopped = asyncio.Event()
        self._drained: asyncio.Event | None = None

    async def start(self) -> int:
        """Bind and listen; returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Protocol(self), self.host, self.port, ssl=self.ssl,
            ssl_handshake_timeout=self.ssl_handshake_timeout if self.ssl is not None else None)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        """Stop listening, GOAWAY every connection, let open calls finish for `grace` s, then
        close what is left (its handlers see `on_reset`)."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for protocol in list(self.connections):
            protocol.conn.drain()
            protocol.flush()
        self._drained = asyncio.Event()
        final = asyncio.get_running_loop().call_later(min(_PING_ACK_WAIT, grace),
                                                      self._final_goaway)
        self.check_drained()
        try:
            await asyncio.wait_for(self._drained.wait(), grace)
        except TimeoutError:
            pass
        final.cancel()
        for protocol in list(self.connections):
            if protocol.transport is not None:
                protocol.transport.close()
            protocol.connection_lost(None)
        self._stopped.set()

    def _final_goaway(self) -> None:
        """For peers that did not ACK the drain PING in time."""
        for protocol in list(self.connections):
            if not protocol.conn.goaway_sent:
                protocol.conn.goaway()
                protocol.flush()
        self.check_drained()

    def check_drained(self) -> None:
        """Called as calls and connections end; completes a shutdown drain."""
        if self._drained is not None and all(p.idle() for p in self.connections):
            self._drained.set()

    async def wait(self) -> None:
        await self._stopped.wait()
