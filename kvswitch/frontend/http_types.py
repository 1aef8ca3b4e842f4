"""The HTTP/1.1 server's contract with its app: the request it hands over, the two kinds of
answer (`Reply`, `StreamReply`), and the status line every response starts with."""

from __future__ import annotations

import email.utils
import http
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from kvswitch.errors import KvswitchError

__all__ = ["App", "HttpRequest", "Reply", "StreamReply", "status_line"]


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    """The URL path, without the query string."""
    headers: dict[str, str]
    """Lower-case names; a repeated header keeps its last value."""
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole response."""

    status: int
    body: bytes = b""
    content_type: bytes = b"application/json"


@dataclass(frozen=True, slots=True)
class StreamReply:
    """A 200 whose body is written event by event as `events` yields them."""

    events: AsyncIterator[bytes]
    content_type: bytes = b"text/event-stream; charset=utf-8"
    last: bytes | None = None
    """An event ending with this is the last one (written with the terminating chunk); an
    iterator that ends without it gets it written for it."""
    on_error: Callable[[Exception], bytes] | None = None
    """The in-band bytes that end a stream whose iterator raised (the 200 is already out)."""
    headers: bytes = b"cache-control: no-cache\r\nx-accel-buffering: no\r\n"


class App(Protocol):
    def handle(self, request: HttpRequest) -> Awaitable[Reply | StreamReply]: ...

    def refuse(self, error: KvswitchError) -> Reply:
        """The response for a request the server refuses itself (400, 413)."""
        ...


_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}


class _DateHeader:
    """The `date` header line (RFC 9110 §6.6.1: a server with a clock sends it), formatted once
    per second rather than per response."""

    def __init__(self) -> None:
        self._second = -1
        self._line = b""

    def __call__(self) -> bytes:
        now = time.time()
        if int(now) != self._second:
            self._second = int(now)
            self._line = b"date: %s\r\n" % email.utils.formatdate(now, usegmt=True).encode()
        return self._line


_date_header = _DateHeader()


def status_line(status: int) -> bytes:
    """The status line and the headers every response carries."""
    return b"HTTP/1.1 %d %s\r\n%s" % (status, _REASONS.get(status, b""), _date_header())

