"""A lean asyncio HTTP/1.1 server for the frontend: httptools parses, one Protocol per connection.

Why not uvicorn + ASGI: per request and per SSE event, the ASGI message dicts, `send`/`receive`
coroutines and the disconnect-watcher tasks cost more CPU than the transcoding itself. Here an
app is one coroutine `handle(HttpRequest) -> Reply | StreamReply`; the connection writes the
answer straight to its transport.

- Keep-alive and pipelining: requests are parsed as they arrive and served one at a time in
  order (a connection with many queued requests stops reading until it catches up).
- Bodies: Content-Length or chunked (httptools decodes chunks); over `max_body_bytes` → 413,
  malformed HTTP → 400, both answered in turn and followed by closing the connection. A
  `transfer-encoding` other than chunked (e.g. `gzip, chunked`) is refused with 501 rather than
  read as plain bytes.
- Limits on the head and deadlines (`HttpLimits`, applied by `http_guard.RequestGuard`): 414,
  431, 408, each answered, then the connection closes.
- HEAD gets the headers of the app's answer (to the same request), without its body.
- Every response carries a `date` header (as uvicorn and Envoy send; `http_types`).
- Streams: chunked transfer encoding, one `transport.write` per event (the status line and
  headers go with the first event, the terminating chunk with the last); `pause_writing`
  holds the stream until the client reads again.
- A client that disconnects cancels the task serving its request (and with it the Generate
  call behind it, so the engine frees the request) — no watcher task per request.
- `Server.serve(sock)` runs until `stop()`; idle connections close at once and busy ones after
  their current response (or when the grace period ends).
- TLS (`ssl` set): a client must finish its handshake within `ssl_handshake_timeout` seconds
  of connecting; the head deadline starts with the first byte after it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import ssl as ssl_module
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import cast

import httptools

from kvswitch.errors import (
    InvalidRequest,
    KvswitchError,
    PayloadTooLarge,
    Unavailable,
    Unimplemented,
)
from kvswitch.frontend.http_guard import RequestGuard
from kvswitch.frontend.http_types import App, HttpRequest, Reply, StreamReply, status_line
from kvswitch.limits import HTTP_DEFAULTS, HttpLimits

__all__ = ["App", "HttpRequest", "Reply", "Server", "StreamReply"]

logger = logging.getLogger(__name__)

_MAX_QUEUED = 16
"""Pipelined requests parsed ahead of the one being served before reading pauses."""
_LINGER_SECONDS = 2.0



@dataclass(slots=True)
class _Pending:
    """A parsed request waiting its turn, or a refusal to answer in its place."""

    request: HttpRequest
    keep_alive: bool
    refusal: KvswitchError | None = None
    chunked: bool = True
    """The client speaks HTTP/1.1: a stream can be chunked."""


class _Connection(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self._server = server
        self._app = server.app
        self._limit = server.limits.max_body_bytes
        self.guard = RequestGuard(server.limits, time.monotonic())
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._queue: collections.deque[_Pending] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._paused_reading = False
        self._drain: asyncio.Future[None] | None = None
        self._writable = True
        self._broken = False  # no more parsing: a refusal is queued, then the connection closes
        self.lost = False
        # The request being parsed.
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._refused = False

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._server.connections.discard(self)
        if self._task is not None:
            self._task.cancel()  # the client left: stop serving it (cancels its Generate)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("client disconnected"))

    def pause_writing(self) -> None:
        self._writable = False

    def resume_writing(self) -> None:
        self._writable = True
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._broken:
            return
        self.guard.received(len(data), time.monotonic())
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # an Upgrade we do not take: the request is served as plain HTTP/1.1
        except httptools.HttpParserError as exc:
            if not self._broken:
                self._refuse(InvalidRequest(f"malformed HTTP request: {exc}"))
            return
        if not self._broken and (error := self.guard.parsed()) is not None:
            self._refuse(error)

    # --- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = b"", {}, [], 0
        self._refused = False
        self.guard.begin(time.monotonic())

    def on_url(self, url: bytes) -> None:
        if self._refused:
            return
        if (error := self.guard.url(len(url))) is not None:
            self._refuse(error)
            return
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        if (error := self.guard.header(len(name) + len(value))) is not None:
            self._refuse(error)
            return
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.guard.headers_done(time.monotonic())
        if self._refused:
            return
        declared = self._headers.get("content-length")
        coding = self._headers.get("transfer-encoding", "").lower().replace(" ", "")
        if coding not in ("", "chunked"):
            # httptools de-chunks `gzip, chunked` and hands over the gzip bytes as if plain.
            self._refuse(Unimplemented(f"transfer-encoding {coding!r} is not supported "
                                       "(only chunked)"))
        elif declared is not None and declared.isdigit() and int(declared) > self._limit:
            self._refuse(PayloadTooLarge(
                f"request body of {declared} bytes is over the limit of {self._limit}"))
        elif (self._headers.get("expect", "").lower() == "100-continue" and not self._queue
              and self._task is None and self._transport is not None):
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._size += len(body)
        if self._size > self._limit:
            self._refuse(PayloadTooLarge(f"request body is over the limit of {self._limit} "
                                         "bytes"))
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.guard.complete(time.monotonic())
        if self._refused:
            return
        path = self._url.partition(b"?")[0].decode("latin-1")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = HttpRequest(self._parser.get_method().decode("latin-1"), path, self._headers,
                              body)
        parser = self._parser
        self._queue.append(_Pending(request, parser.should_keep_alive(),
                                    chunked=parser.get_http_version() != "1.0"))
        if self._task is None:
            self._next()
        elif len(self._queue) >= _MAX_QUEUED and self._transport is not None:
            self._paused_reading = True
            self._transport.pause_reading()

    # --- serving ----------------------------------------------------------------------------

    def _refuse(self, error: KvswitchError) -> None:
        """Answer `error` after whatever is queued before it, then close."""
        self._refused = self._broken = True
        request = HttpRequest("", "", {}, b"")
        self._queue.append(_Pending(request, keep_alive=False, refusal=error))
        if self._transport is not None:
            self._transport.pause_reading()
        if self._task is None:
            self._next()

    def _next(self) -> None:
        if self._queue:
            pending = self._queue.popleft()
            self._task = asyncio.get_running_loop().create_task(self._serve(pending))
            if self._paused_reading and len(self._queue) < _MAX_QUEUED // 2 and not self._broken:
                self._paused_reading = False
                assert self._transport is not None
                self._transport.resume_reading()
        else:
            self._task = None
            self.guard.served(time.monotonic())
            if self._server.stopping and self._transport is not None:
                self._transport.close()

    async def _serve(self, pending: _Pending) -> None:
        keep_alive = pending.keep_alive and not self._server.stopping
        try:
            if pending.refusal is not None:
                self._write_reply(self._app.refuse(pending.refusal), keep_alive=False)
            else:
                reply = await self._app.handle(pending.request)
                if isinstance(reply, Reply):
                    self._write_reply(reply, keep_alive, pending.request.method == "HEAD")
                else:
                    keep_alive = await self._write_stream(reply, keep_alive, pending.chunked)
        except asyncio.CancelledError:
            if not self.lost:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            return
        except OSError:
            keep_alive = False
        except Exception:
            logger.exception("request to %s failed", pending.request.path)
            keep_alive = False
        if self.lost:
            return
        if not keep_alive:
            assert self._transport is not None
            if pending.refusal is not None:
                self._linger()
            else:
                self._transport.close()
            self._task = None
            return
        self._next()

    def _linger(self) -> None:
        """Close after a refusal without losing it: closing a socket with unread request bytes
        sends a TCP reset, which can destroy the response before the client (or a proxy
        still sending the body: Envoy then answers 503) reads it. So, as nginx's lingering
        close does, end the write side, read and drop what still comes for a moment, close."""
        transport = self._transport
        assert transport is not None
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()  # data_received drops it: the connection is broken
        asyncio.get_running_loop().call_later(_LINGER_SECONDS, transport.close)

    def _write_reply(self, reply: Reply, keep_alive: bool, head: bool = False) -> None:
        assert self._transport is not None
        self._transport.write(b"%scontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s" % (
            status_line(reply.status), reply.content_type, len(reply.body),
            b"" if keep_alive else b"connection: close\r\n", b"" if head else reply.body))

    async def _write_stream(self, reply: StreamReply, keep_alive: bool, chunked: bool) -> bool:
        """The events, chunked (HTTP/1.1) or ended by closing the connection (HTTP/1.0);
        returns whether the connection may carry another request."""
        transport = self._transport
        assert transport is not None
        keep_alive = keep_alive and chunked
        events, last = reply.events, reply.last
        head: bytes | None = b"%scontent-type: %s\r\n%s%s%s\r\n" % (
            status_line(200), reply.content_type,
            b"transfer-encoding: chunked\r\n" if chunked else b"", reply.headers,
            b"" if keep_alive else b"connection: close\r\n")
        term = b"0\r\n\r\n" if chunked else b""
        try:
            try:
                async for event in events:
                    if not event:
                        continue
                    chunk = b"%x\r\n%s\r\n" % (len(event), event) if chunked else event
                    if last is not None and event.endswith(last):
                        transport.write(head + chunk + term if head else chunk + term)
                        return keep_alive
                    transport.write(head + chunk if head else chunk)
                    head = None
                    if not self._writable:
                        await self._drained()
                # The iterator ended without its last event: write it now.
                end = last or b""
            except (asyncio.CancelledError, OSError):
                raise
            except Exception as exc:
                if reply.on_error is None:
                    raise
                end = reply.on_error(exc)
            if end and chunked:
                end = b"%x\r\n%s\r\n" % (len(end), end)
            transport.write((head or b"") + end + term)
            return keep_alive
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def _drained(self) -> None:
        self._drain = asyncio.get_running_loop().create_future()
        try:
            await self._drain
        finally:
            self._drain = None

    def check_timeouts(self, now: float, stopping: bool = False) -> None:
        """Close a connection whose request ran out of time (`RequestGuard.expired`: a 408
        first, as nginx's client_header_timeout and client_body_timeout do) or that idled past
        the idle timeout (silently). When the server stops (`stopping`), every connection not
        serving a request closes, a half-received request answered 503."""
        if self._task is not None or self._queue or self._transport is None:
            return
        guard = self.guard
        error: KvswitchError | None = (
            Unavailable("the server is shutting down") if stopping and guard.receiving
            else guard.expired(now))
        if error is not None:
            if not self._broken:
                self._broken = True
                logger.info("closing a connection: %s", error.message)
                self._write_reply(self._app.refuse(error), keep_alive=False)
            self._transport.close()
        elif stopping or guard.idle(now):
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()


@dataclass
class Server:
    """Serves `app` on listening sockets until `stop()`."""

    app: App
    limits: HttpLimits = HTTP_DEFAULTS
    grace_period: float = 10.0
    """How long `stop()` waits for requests in flight before aborting their connections."""
    ssl: ssl_module.SSLContext | None = None
    """Serve HTTPS with this context instead of plain HTTP."""
    ssl_handshake_timeout: float | None = None
    """With `ssl`: seconds a client gets to finish its handshake (None: asyncio's 60)."""
    connections: set[_Connection] = field(default_factory=set)
    stopping: bool = False
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    def stop(self) -> None:
        self.stopping = True
        self._stopped.set()

    async def serve(self, sock: socket.socket, *, on_started: Callable[[], Awaitable[None]]
                    | None = None) -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _Connection(self), sock=sock, backlog=2048, ssl=self.ssl,
            ssl_handshake_timeout=self.ssl_handshake_timeout if self.ssl is not None else None)
        if on_started is not None:
            await on_started()
        sweeper = loop.create_task(self._sweep())
        try:
            await self._stopped.wait()
        finally:
            sweeper.cancel()
            server.close()
            await self._drain_connections()

    async def _sweep(self) -> None:
        limits = self.limits
        # Often enough that a deadline is kept to within a quarter of the shortest one.
        period = max(0.01, min(1.0, limits.head_timeout / 4, limits.body_timeout / 4,
                               limits.idle_timeout / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self.connections):
                conn.check_timeouts(now)

    async def _drain_connections(self) -> None:
        now = time.monotonic()
        for conn in list(self.connections):
            conn.check_timeouts(now, stopping=True)
        deadline = now + self.grace_period
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.abort()
        await asyncio.sleep(0)  # let the aborted connections' tasks see their cancellation
