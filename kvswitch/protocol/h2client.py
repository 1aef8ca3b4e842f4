"""A minimal asyncio HTTP/2 client for gRPC: unary request -> streamed (or one) responses.

Used for the frontend's Generate hot path and the EPP's engine telemetry (SubscribeKvEvents,
GetLoads, HealthCheck, GetServerInfo). Why not grpc.aio: its per-message cost (a
completion-queue poller thread handing each received message to the event loop, one batch op
and one future per read) exceeds the whole of the frontend's transcoding
(docs/benchmarks/transports.md). Here a connection is an `asyncio.Protocol` that parses frames straight out of
`data_received`; every gRPC message already received for a stream is handed over in one
`read_batch()`, so a slow reader gets several engine messages at once. A call started with
`on_message` instead hands each message to that callback straight from `data_received` (no
future, no task wake-up per read: what a long-lived telemetry stream wants) and its owner
awaits `ended()`.

Scope, on purpose: h2c (prior knowledge), unary request -> streamed responses (`unary()` waits
for exactly one), no compression. Large flow-control windows are granted up front and refilled
as they are used, so a stream can live for days. A call may carry a deadline (sent as
`grpc-timeout`; when it passes the call fails with DEADLINE_EXCEEDED and is reset). A lost
connection fails every open call with UNAVAILABLE at once. With `keepalive` (seconds) a
connection sends PINGs and drops itself, failing its calls, when one goes unanswered for an
interval (a half-open connection to a silent peer). Frames and HPACK are the shared frame
layer (`kvswitch.protocol.http2`): a frame that breaks RFC 9113's rules, or a header block over
`MAX_HEADER_BLOCK`, is a connection error: GOAWAY, then the same. A call this channel cannot
start (no connection, window or stream slot) raises `NotAccepted`, itself an UNAVAILABLE
`StreamError`: the frontend then uses grpc.aio instead. HPACK is `hpack` (python-hyper).
"""

from __future__ import annotations

import asyncio
import math
import ssl as ssl_module
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

from kvswitch.protocol.h2state import REFILL_AT, ConnectionState
from kvswitch.protocol.http2 import (
    ACK,
    CANCEL,
    DATA,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_FRAME,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ACK,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
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

__all__ = ["MAX_RESPONSE_MESSAGE", "H2Channel", "MessageCallback", "NotAccepted", "StreamCall",
           "StreamError", "parse_target", "timeout_header"]

_REFILL_AT = REFILL_AT
MAX_HEADER_BLOCK = 256 * 1024
"""Largest header block (HEADERS + CONTINUATION) and decoded header list read before the
connection is dropped; advertised as SETTINGS_MAX_HEADER_LIST_SIZE."""
MAX_RESPONSE_MESSAGE = 64 * 1024 * 1024
"""Largest response message a call takes (what the frontend's grpc.aio fallback allows); a
longer one announced fails the call with RESOURCE_EXHAUSTED before its bytes are kept."""
_KEEPALIVE_PING = b"kvswkeep"
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_RST_CODES = {0x7: grpc.StatusCode.UNAVAILABLE, 0x8: grpc.StatusCode.CANCELLED,
              0xB: grpc.StatusCode.RESOURCE_EXHAUSTED}


class StreamError(Exception):
    """A call that ended with a non-OK gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class NotAccepted(StreamError):
    """This channel cannot take the call now (no connection, window or stream slot)."""

    def __init__(self, details: str = "call not accepted") -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details)


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


class StreamCall:
    """One call's received messages; `read_batch()` returns all those waiting."""

    __slots__ = (
        "_conn",
        "_ended",
        "_error",
        "_have",
        "_headers_seen",
        "_id",
        "_messages",
        "_need",
        "_on_message",
        "_parse",
        "_partial",
        "_received",
        "_timer",
        "_waiter",
    )

    def __init__(self, conn: _Connection, stream_id: int, parse: Callable[[bytes], Any],
                 on_message: MessageCallback | None = None) -> None:
        self._conn, self._id, self._parse = conn, stream_id, parse
        self._on_message = on_message
        # A partial message as received (joined once whole: a big one arrives in many reads),
        # its size so far and the size that completes it (or its 5-byte prefix).
        self._partial: list[bytes] = []
        self._have = self._need = 0
        self._messages: list[Any] = []
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._error: Exception | None = None
        """A `StreamError`, or what `on_message` raised."""
        self._headers_seen = False
        self._received = 0  # DATA bytes since this stream's window was last refilled
        self._timer: asyncio.TimerHandle | None = None

    async def read_batch(self) -> list[Any]:
        """The messages received so far (at least one), or [] once the call ended OK;
        raises `StreamError` when it ended otherwise."""
        while not self._messages:
            if self._ended:
                if self._error is None:
                    return []
                raise self._error
            await self._wait()
        messages, self._messages = self._messages, []
        return messages

    async def ended(self) -> None:
        """Wait until the call ends: returns when it ended OK, raises `StreamError` when it
        ended otherwise, or what `on_message` raised (which ended it)."""
        while not self._ended:
            await self._wait()
        if self._error is not None:
            raise self._error

    async def response(self) -> Any:
        """A unary call's one response, once the call ended OK; raises `StreamError` when it
        ended otherwise. Cancelling the caller cancels the call."""
        try:
            while not self._ended:
                await self._wait()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if self._error is not None:
            raise self._error
        if len(self._messages) != 1:
            raise StreamError(grpc.StatusCode.INTERNAL,
                              f"unary call answered {len(self._messages)} messages")
        return self._messages[0]

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def cancel(self) -> None:
        """Reset the stream (the server aborts the request); a no-op once it ended."""
        if not self._ended:
            self._finish(StreamError(grpc.StatusCode.CANCELLED, "cancelled by the client"))
            self._conn.reset(self._id)

    def _expire(self) -> None:
        if not self._ended:
            self._finish(StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))
            self._conn.reset(self._id)

    # --- fed by the connection -------------------------------------------------------------

    def _data(self, data: bytes) -> None:
        self._received += len(data)
        if self._received >= _REFILL_AT:
            self._conn.refill(self._id, self._received)
            self._received = 0
        if self._partial:
            self._partial.append(data)
            self._have += len(data)
            if self._have < self._need:
                return
            buffer = b"".join(self._partial)
            self._partial, self._have = [], 0
        else:
            buffer = data
        offset, size = 0, len(buffer)
        parse, messages = self._parse, self._messages
        error: StreamError | None = None
        try:
            while size - offset >= 5:
                length = U32.unpack_from(buffer, offset + 1)[0]
                if length > MAX_RESPONSE_MESSAGE:
                    error = StreamError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"response message of {length} bytes over the "
                                        f"{MAX_RESPONSE_MESSAGE} limit")
                    break
                end = offset + 5 + length
                if end > size:
                    break
                if buffer[offset]:
                    raise ValueError("compressed message without negotiated encoding")
                messages.append(parse(buffer[offset + 5:end]))
                offset = end
        except Exception as exc:  # noqa: BLE001 - a bad message fails its call, not the others
            error = StreamError(grpc.StatusCode.INTERNAL, f"bad response message: {exc}")
        if offset < size and error is None:
            rest = buffer[offset:]
            self._partial, self._have = [rest], len(rest)
            self._need = 5 + U32.unpack_from(rest, 1)[0] if len(rest) >= 5 else 5
        if self._on_message is not None and messages:
            self._dispatch()  # those before a bad message still count
        if error is not None:
            self._fail(error)
        else:
            self._wake()

    def _dispatch(self) -> None:
        """Hand the messages received to `on_message`, in order, until it says stop."""
        on_message = self._on_message
        assert on_message is not None
        messages, self._messages = self._messages, []
        for message in messages:
            try:
                go_on = on_message(message)
            except Exception as exc:  # noqa: BLE001 - the owner's error ends its call; ended() raises it
                self._fail(exc)
                return
            if not go_on:
                self.cancel()
                return

    def _fail(self, error: Exception) -> None:
        if not self._ended:
            self._finish(error)
            self._conn.reset(self._id)

    def _headers(self, values: Mapping[str, str], end_stream: bool) -> None:
        if not self._headers_seen and not end_stream:
            self._headers_seen = True
            status = values.get(":status", "200")
            if status != "200":
                self._finish(StreamError(_http_status_code(status), f"HTTP status {status}"))
            return
        code = values.get("grpc-status")
        if code is None:
            status = values.get(":status", "200")
            self._finish(StreamError(_http_status_code(status) if status != "200"
                                     else grpc.StatusCode.INTERNAL, "missing grpc-status"))
        elif code == "0":
            self._finish(None)
        else:
            details = _unquote(values.get("grpc-message", ""))
            self._finish(StreamError(_CODES.get(int(code), grpc.StatusCode.UNKNOWN), details))

    def _finish(self, error: Exception | None) -> None:
        if not self._ended:
            self._ended, self._error = True, error
            self._conn.streams.pop(self._id, None)
            if self._timer is not None:
                self._timer.cancel()
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


MessageCallback = Callable[[Any], bool]
"""Takes one parsed message as it arrives; returns False to end the call (it is cancelled)."""


def _http_status_code(status: str) -> grpc.StatusCode:
    # gRPC's HTTP-to-status mapping (doc/http-grpc-status-mapping.md).
    return {"400": grpc.StatusCode.INTERNAL, "401": grpc.StatusCode.UNAUTHENTICATED,
            "403": grpc.StatusCode.PERMISSION_DENIED, "404": grpc.StatusCode.UNIMPLEMENTED,
            "429": grpc.StatusCode.UNAVAILABLE, "502": grpc.StatusCode.UNAVAILABLE,
            "503": grpc.StatusCode.UNAVAILABLE, "504": grpc.StatusCode.UNAVAILABLE,
            }.get(status, grpc.StatusCode.UNKNOWN)


def _unquote(message: str) -> str:
    if "%" not in message:
        return message
    from urllib.parse import unquote
    return unquote(message)


def timeout_header(seconds: float) -> str:
    """A deadline as gRPC's `grpc-timeout` value: at most 8 digits and a unit, rounded up."""
    millis = max(1, math.ceil(seconds * 1000))
    return f"{millis}m" if millis < 10**8 else f"{min(math.ceil(seconds), 10**8 - 1)}S"


class _Connection(asyncio.Protocol):
    def __init__(self, authority: str, user_agent: str = "kvswitch-frontend",
                 on_lost: Callable[[], None] | None = None,
                 keepalive: float | None = None, scheme: str = "http") -> None:
        self.loop = asyncio.get_running_loop()
        self.scheme = scheme
        """The calls' `:scheme`: "https" over TLS, "http" over h2c."""
        self.keepalive = keepalive
        """Seconds between keepalive PINGs; a PING not answered by the next one ends the
        connection (a half-open TCP connection to a silent peer). None: no PINGs."""
        self._ping_timer: asyncio.TimerHandle | None = None
        self._ping_answered = True
        self._last_received = self.loop.time()
        self.authority = authority
        self.user_agent = user_agent
        self.on_lost = on_lost
        """Called once when the connection drops or the server sends GOAWAY."""
        self.streams: dict[int, StreamCall] = {}
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._next_id = 1
        self._reader = FrameReader(self._on_data, self._on_control,
                                   max_header_block=MAX_HEADER_BLOCK)
        # Plain DATA frames are gathered per stream and handed over once per read, so a stream
        # whose messages arrived together is parsed and woken once.
        self._gathered: dict[int, list[bytes]] = {}
        self._decoder = HeaderDecoder(MAX_HEADER_BLOCK, "utf-8")
        self._fixed_headers: dict[tuple[str, float | None], bytes] = {}
        self._connection = ConnectionState(_REFILL_AT)
        self._failed = False
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.keepalive is not None:
            self._ping_timer = self.loop.call_later(self.keepalive, self._ping)
        self.transport.write(PREFACE + self._connection.initiate({  # type: ignore[union-attr]
            SETTINGS_ENABLE_PUSH: 0, SETTINGS_INITIAL_WINDOW_SIZE: MAX_WINDOW,
            SETTINGS_MAX_FRAME_SIZE: MAX_FRAME, SETTINGS_MAX_HEADER_LIST_SIZE: MAX_HEADER_BLOCK}))

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
            self._failed = True
            self._closing()
            self.transport.abort()
            self.connection_lost(None)
            return
        self._ping_answered = False
        self.transport.write(frame(PING, 0, 0, _KEEPALIVE_PING))
        self._ping_timer = self.loop.call_later(self.keepalive, self._ping)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ping_timer is not None:
            self._ping_timer.cancel()
            self._ping_timer = None
        self._closing()
        for call in list(self.streams.values()):
            call._finish(StreamError(grpc.StatusCode.UNAVAILABLE,
                                     f"connection to {self.authority} lost"))

    def _closing(self) -> None:
        """No new streams here from now on; tell the owner once."""
        if not self.closed:
            self.closed = True
            if self.on_lost is not None:
                self.on_lost()

    def start(self, path: str, metadata: Sequence[tuple[str, str]], body: bytes,
              parse: Callable[[bytes], Any], timeout: float | None = None,
              on_message: MessageCallback | None = None) -> StreamCall:
        size = len(body) + 5
        connection = self._connection
        if (self.closed or self.transport is None or self._next_id >= 2**31
                or len(self.streams) >= connection.peer_max_streams
                or size > min(connection.send_window, connection.peer_initial_window)):
            raise NotAccepted(f"{self.authority}: no connection, window or stream slot")
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
        call = StreamCall(self, stream_id, parse, on_message)
        self.streams[stream_id] = call
        if timeout is not None:
            call._timer = self.loop.call_later(timeout, call._expire)
        message = b"\x00" + U32.pack(len(body)) + body
        connection.send_window -= size
        step = connection.peer_max_frame
        out = header_frames(stream_id, block, False, step)
        for start in range(0, len(message), step):
            last = start + step >= len(message)
            out.append(frame(DATA, END_STREAM if last else 0, stream_id,
                              message[start:start + step]))
        self._send(b"".join(out))
        return call

    def reset(self, stream_id: int) -> None:
        if not self.closed and self.transport is not None:
            self._send(frame(RST_STREAM, 0, stream_id, U32.pack(CANCEL)))

    def refill(self, stream_id: int, received: int) -> None:
        """Give a long-lived stream back the window its received bytes used."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(WINDOW_UPDATE, 0, stream_id, U32.pack(received)))

    def _send(self, data: bytes) -> None:
        # Calls started (or reset) in the same loop iteration leave in one write: one syscall
        # for the batch of requests that arrived together rather than one each.
        if not self._out:
            self.loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.closed:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def data_received(self, data: bytes) -> None:
        try:
            self._receive(data)
        except H2ProtocolError as exc:
            if self._gathered:  # what arrived before the broken frame still counts
                try:
                    self._deliver()
                except H2ProtocolError:
                    pass  # over the window too: the connection fails all the same
            self._fail(exc.code, exc.reason)

    def _fail(self, code: int, reason: str) -> None:
        """A connection error: GOAWAY, close, every open call UNAVAILABLE."""
        self._failed = True
        self._write(goaway_frame(0, code, reason))
        self._closing()
        self.close()
        self.connection_lost(None)

    def _receive(self, data: bytes) -> None:
        if self._failed:
            return
        self._last_received = self.loop.time()
        self._reader.feed(data)
        if self._gathered:
            self._deliver()
        refill = self._connection.refill()
        if refill and self.transport is not None:
            self.transport.write(refill)

    def _deliver(self) -> None:
        """Hand the plain DATA gathered to its calls, counted against the connection window
        (once per stream and read, not per frame: the same check, fewer calls)."""
        gathered, self._gathered = self._gathered, {}
        streams, received = self.streams, self._connection.received
        for stream_id, parts in gathered.items():
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            received(len(data))
            call = streams.get(stream_id)
            if call is not None:
                call._data(data)

    def _on_data(self, flags: int, stream_id: int, payload: bytes, length: int) -> None:
        if not flags:
            parts = self._gathered.get(stream_id)
            if parts is None:
                self._gathered[stream_id] = [payload]
            else:
                parts.append(payload)
            return
        if self._gathered:  # in order: what came before this frame first
            self._deliver()
        self._connection.received(length)
        call = self.streams.get(stream_id)
        if call is None:
            return
        if flags & PADDED:
            call._received += length - len(payload)  # padding counts against the window too
        if payload:
            call._data(payload)
        if flags & END_STREAM:
            call._finish(StreamError(grpc.StatusCode.INTERNAL, "stream ended without trailers"))

    def _on_control(self, kind: int, flags: int, stream_id: int, payload: bytes,
                    length: int) -> None:
        if self._gathered:  # in order: what came before this frame first
            self._deliver()
        if kind == HEADERS:
            call = self.streams.get(stream_id)
            headers = self._decoder.decode(payload)  # always, to keep HPACK state in step
            if call is not None:
                call._headers(headers, bool(flags & END_STREAM))
        elif kind == SETTINGS and not flags & ACK:
            self._connection.on_settings(payload)  # only future streams: ours send at once
            self._write(SETTINGS_ACK)
        elif kind == PING and not flags & ACK:
            self._write(ping_ack(payload))
        elif kind == PING:
            self._ping_answered = True
        elif kind == WINDOW_UPDATE and stream_id == 0:
            self._connection.on_window_update(payload)
        elif kind == RST_STREAM:
            call = self.streams.get(stream_id)
            if call is not None:
                code = U32.unpack_from(payload)[0]
                call._finish(StreamError(_RST_CODES.get(code, grpc.StatusCode.INTERNAL),
                                         f"stream reset by the server (HTTP/2 error {code})"))
        elif kind == GOAWAY:
            last, _ = goaway_fields(payload)
            self._closing()  # no new streams here; those the server never saw fail now
            for sid, call in list(self.streams.items()):
                if sid > last:
                    call._finish(StreamError(grpc.StatusCode.UNAVAILABLE,
                                             "connection closing (GOAWAY)"))

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

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
                 server_hostname: str | None = None) -> None:
        self._ssl, self._server_hostname = ssl, server_hostname
        """TLS (the context offers ALPN h2) instead of h2c when set."""
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
                                self._keepalive, "https" if self._ssl is not None else "http"),
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
