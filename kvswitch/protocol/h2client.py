"""A minimal asyncio HTTP/2 client for gRPC: unary request -> streamed (or one) responses.

Used for the frontend's Generate hot path and the EPP's engine telemetry (SubscribeKvEvents,
GetLoads, HealthCheck, GetServerInfo). Why not grpc.aio: its per-message cost exceeds the whole
of the frontend's transcoding (docs/benchmarks/transports.md). The protocol is the sans-IO
`kvswitch.protocol.h2client_core.H2ClientConnection`; here a connection is an `asyncio.Protocol`
that feeds it what arrives and writes what it queues, and a call is a
`kvswitch.protocol.h2call.StreamCall`. Every message already received for a call
is handed over in one `read_batch()`, so a slow reader gets several at once. A call started with
`on_message` instead hands each message to that callback straight from `data_received` (no
future, no task wake-up per read: what a long-lived telemetry stream wants) and its owner
awaits `ended()`.

Scope, on purpose: h2c (prior knowledge) or TLS with ALPN h2 (`:scheme` https), unary request
-> streamed responses (`unary()` waits for exactly one), no compression. A call may carry a
deadline (sent as `grpc-timeout`; when it passes the call fails with DEADLINE_EXCEEDED and is
reset). A lost or broken connection fails every open call with UNAVAILABLE at once. With
`keepalive` (seconds) a connection sends PINGs and drops itself, failing its calls, when one
goes unanswered for an interval (a half-open connection to a silent peer). A call this channel
cannot start (no connection, window or stream slot) raises `NotAccepted`, itself an UNAVAILABLE
`StreamError`: the frontend then uses grpc.aio instead.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc

from kvswitch.protocol.h2call import MessageCallback, NotAccepted, StreamCall, StreamError
from kvswitch.protocol.h2client_core import (
    MAX_HEADER_BLOCK,
    MAX_RESPONSE_MESSAGE,
    CallEnded,
    ClientEvent,
    GoAwayReceived,
    H2ClientConnection,
    MessagesReceived,
    PingAcked,
    timeout_header,
)

__all__ = ["MAX_HEADER_BLOCK", "MAX_RESPONSE_MESSAGE", "H2Channel", "MessageCallback",
           "NotAccepted", "StreamCall", "StreamError", "parse_target", "timeout_header"]

_KEEPALIVE_PING = b"kvswkeep"
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def parse_target(target: str) -> list[tuple[str, int]] | None:
    """`host:port`, `[v6]:port`, `ipv4:a:p,b:p` or `ipv6:[a]:p,...`; None for anything else
    (unix sockets, dns:/// URIs) which stays with grpc.aio."""
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    else:
        if "," in target or "/" in target or target.startswith(("unix:", "dns:")):
            return None
    out = []
    for part in target.split(","):
        host, sep, port = part.rpartition(":")
        if not sep or not port.isdigit():
            return None
        out.append((host.strip("[]"), int(port)))
    return out


class _Connection(asyncio.Protocol):
    """Drives one `H2ClientConnection` over an asyncio transport."""

    def __init__(self, authority: str, user_agent: str = "kvswitch-frontend",
                 on_lost: Callable[[], None] | None = None,
                 keepalive: float | None = None, scheme: str = "http") -> None:
        self.loop = asyncio.get_running_loop()
        self.core = H2ClientConnection(authority, scheme=scheme, user_agent=user_agent)
        self.authority = authority
        self.keepalive = keepalive
        """Seconds between keepalive PINGs; a PING not answered by the next one ends the
        connection (a half-open TCP connection to a silent peer). None: no PINGs."""
        self._ping_timer: asyncio.TimerHandle | None = None
        self._ping_answered = True
        self._last_received = self.loop.time()
        self.on_lost = on_lost
        """Called once when the connection drops or the server sends GOAWAY."""
        self.calls: dict[int, StreamCall] = {}
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._flush_due = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.keepalive is not None:
            self._ping_timer = self.loop.call_later(self.keepalive, self._ping)
        self.core.initiate()
        self._flush()

    def _ping(self) -> None:
        if self.closed or self.transport is None or self.keepalive is None:
            return
        quiet_since = self._last_received
        if self._ping_answered and self.loop.time() - quiet_since < self.keepalive:
            # Frames arrived within the interval: the peer is alive, no PING needed (servers
            # count PINGs on a busy connection as abuse less often than on an idle one).
            self._ping_timer = self.loop.call_at(quiet_since + self.keepalive, self._ping)
            return
        if not self._ping_answered:
            # No answer for a whole interval: the peer is gone, whatever TCP says. Abort (a
            # close would wait to flush into a connection that no longer drains).
            self._closing()
            self.transport.abort()
            self.connection_lost(None)
            return
        self._ping_answered = False
        self.core.ping(_KEEPALIVE_PING)
        self._flush()
        self._ping_timer = self.loop.call_later(self.keepalive, self._ping)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ping_timer is not None:
            self._ping_timer.cancel()
            self._ping_timer = None
        self._closing()
        self._handle(self.core.lost(f"connection to {self.authority} lost"))

    def _closing(self) -> None:
        """No new streams here from now on; tell the owner once."""
        if not self.closed:
            self.closed = True
            if self.on_lost is not None:
                self.on_lost()

    def start(self, path: str, metadata: Sequence[tuple[str, str]], body: bytes,
              parse: Callable[[bytes], Any], timeout: float | None = None,
              on_message: MessageCallback | None = None) -> StreamCall:
        stream_id = None
        if not self.closed and self.transport is not None:
            stream_id = self.core.start_call(path, metadata, body, timeout)
        if stream_id is None:
            raise NotAccepted(f"{self.authority}: no connection, window or stream slot")
        call = self.calls[stream_id] = StreamCall(self, stream_id, parse, on_message)
        if timeout is not None:
            call._timer = self.loop.call_later(timeout, call._expire)
        self._send()
        return call

    def reset(self, stream_id: int) -> None:
        self.core.reset(stream_id)
        self._send()

    def _send(self) -> None:
        # Calls started (or reset) in the same loop iteration leave in one write: one syscall
        # for the batch of requests that arrived together rather than one each.
        if not self._flush_due:
            self._flush_due = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        data = self.core.data_to_send()
        if data:
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self.keepalive is not None:
            self._last_received = self.loop.time()
        core = self.core
        for event in core.receive(data):
            if type(event) is MessagesReceived:  # most events: handled without a call
                call = self.calls.get(event.stream_id)
                if call is not None:
                    call._receive(event.messages)
            else:
                self._handle((event,))
        data = core.data_to_send()
        if data:
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(data)
        if core.failed and not self.closed:
            self._closing()
            self.close()

    def _handle(self, events: Iterable[ClientEvent]) -> None:
        calls = self.calls
        for event in events:
            kind = type(event)
            if kind is MessagesReceived:
                call = calls.get(event.stream_id)  # type: ignore[union-attr]
                if call is not None:
                    call._receive(event.messages)  # type: ignore[union-attr]
            elif kind is CallEnded:
                call = calls.get(event.stream_id)  # type: ignore[union-attr]
                if call is not None:
                    status = event.status  # type: ignore[union-attr]
                    call._finish(None if not status else StreamError(
                        _CODES.get(status, grpc.StatusCode.UNKNOWN),
                        event.details))  # type: ignore[union-attr]
            elif kind is PingAcked:
                self._ping_answered = True
            elif kind is GoAwayReceived:
                self._closing()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class H2Channel:
    """Connections to each address of the target, used in turn (round robin per call).

    `on_lost()` is called when an open connection drops or the server says GOAWAY (for the
    EPP: the engine died or is shutting down), not when `close()` closes it.
    """

    def __init__(self, addresses: Sequence[tuple[str, int]], *,
                 user_agent: str = "kvswitch-frontend",
                 on_lost: Callable[[], None] | None = None,
                 keepalive: float | None = None, ssl: ssl_module.SSLContext | None = None,
                 server_hostname: str | None = None, scheme: str | None = None) -> None:
        self._ssl, self._server_hostname = ssl, server_hostname
        """TLS (the context offers ALPN h2) instead of h2c when set."""
        self._scheme = scheme or ("https" if ssl is not None else "http")
        """Sent as `:scheme`: by default https over TLS, else http."""
        self._addresses = list(addresses)
        self._user_agent = user_agent
        self._on_lost = on_lost
        self._keepalive = keepalive
        self._connections: list[_Connection | None] = [None] * len(self._addresses)
        self._connecting: list[asyncio.Task[_Connection] | None] = [None] * len(self._addresses)
        self._turn = 0

    @classmethod
    def to(cls, target: str, **options: Any) -> H2Channel:
        """A channel to `target` (see `parse_target`); ValueError when it is not host:port."""
        addresses = parse_target(target)
        if addresses is None:
            raise ValueError(f"not a host:port target: {target!r}")
        return cls(addresses, **options)

    async def start(self, path: str, metadata: Sequence[tuple[str, str]], body: bytes,
                    parse: Callable[[bytes], Any], timeout: float | None = None,
                    on_message: MessageCallback | None = None) -> StreamCall:
        """Open a call on the next address; `NotAccepted` if that cannot be done here.
        With a `timeout` (seconds, connecting included) the call fails with DEADLINE_EXCEEDED
        when it has not ended by then. With `on_message`, each message goes to it as it
        arrives (see `MessageCallback`) and `read_batch()` returns nothing: await `ended()`."""
        index = self._turn % len(self._addresses)
        self._turn += 1
        conn = self._connections[index]
        if conn is None or conn.closed:
            if timeout is None:
                conn = await self._connect(index)
            else:
                started = asyncio.get_running_loop().time()
                try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel
                    async with asyncio.timeout(timeout):
                        conn = await self._connect(index)
                except TimeoutError:
                    raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      "deadline exceeded while connecting") from None
                timeout = max(0.0, timeout - (asyncio.get_running_loop().time() - started))
        return conn.start(path, metadata, body, parse, timeout, on_message)

    async def unary(self, path: str, body: bytes, parse: Callable[[bytes], Any], *,
                    timeout: float | None = None,
                    metadata: Sequence[tuple[str, str]] = ()) -> Any:
        """One request, one response (parsed); `StreamError` on any failure, UNAVAILABLE
        when the call could not start."""
        call = await self.start(path, metadata, body, parse, timeout)
        return await call.response()

    async def _connect(self, index: int) -> _Connection:
        task = self._connecting[index]
        if task is None:
            task = asyncio.create_task(self._open(index))
            # Its callers may all be cancelled before it ends (a deadline, shutdown): its error
            # must still count as seen, or asyncio logs "exception was never retrieved".
            task.add_done_callback(_consume_error)
            self._connecting[index] = task
        try:
            conn = await asyncio.shield(task)
        except OSError as exc:
            raise NotAccepted(f"cannot connect to {_authority(*self._addresses[index])}: "
                              f"{exc.strerror or exc}") from exc
        finally:
            if self._connecting[index] is task and task.done():
                self._connecting[index] = None
        return conn

    async def _open(self, index: int) -> _Connection:
        host, port = self._addresses[index]
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: _Connection(_authority(host, port), self._user_agent, self._on_lost,
                                self._keepalive, self._scheme),
            host, port, ssl=self._ssl,
            server_hostname=(self._server_hostname or host) if self._ssl is not None else None)
        self._connections[index] = conn
        return conn

    def close(self) -> None:
        for task in self._connecting:
            if task is not None:
                task.cancel()  # else it would open a connection nobody closes
        self._connecting = [None] * len(self._addresses)
        for conn in self._connections:
            if conn is not None:
                conn.close()
        self._connections = [None] * len(self._addresses)


def _consume_error(task: asyncio.Task[_Connection]) -> None:
    if not task.cancelled():
        task.exception()


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
