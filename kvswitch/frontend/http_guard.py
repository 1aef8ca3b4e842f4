"""The HTTP/1.1 server's limits for one connection, sans-IO (`kvswitch.limits.HttpLimits`).

The connection reports what happens (bytes received, the parser's callbacks, the clock) and the
guard answers with the error to refuse the request with, or None:
- the request head (request line and headers) over `max_header_bytes`, counted as bytes arrive
  so a header line that never ends is stopped too, or more than `max_headers` fields: 431; a
  request target over `max_url_bytes`: 414;
- a head not complete `head_timeout` after the request's first byte, or a body not complete
  `body_timeout` after the head: 408. These are deadlines, so a client sending a byte a second
  cannot hold a connection;
- no byte for `idle_timeout` in the middle of a request: 408. A connection with no request
  under way for `idle_timeout` is closed quietly (`idle`).
"""

from __future__ import annotations

from enum import Enum

from kvswitch.errors import HeadersTooLarge, KvswitchError, RequestTimeout, UriTooLong
from kvswitch.limits import HttpLimits

__all__ = ["RequestGuard"]


class _Phase(Enum):
    IDLE = "idle"
    HEAD = "head"
    BODY = "body"


class RequestGuard:
    __slots__ = (
        "head_bytes",
        "headers",
        "last_byte",
        "limits",
        "phase",
        "since",
        "unparsed_head",
        "url_bytes",
    )

    def __init__(self, limits: HttpLimits, now: float) -> None:
        self.limits = limits
        self.phase = _Phase.IDLE
        self.since = now
        """When the current phase began (IDLE: when the last request ended)."""
        self.last_byte = now
        self.unparsed_head = 0
        """Bytes received since the last head ended, before the parser has seen them all."""
        self.head_bytes = 0
        self.url_bytes = 0
        self.headers = 0

    @property
    def receiving(self) -> bool:
        """Part of a request has arrived, not all of it."""
        return self.phase is not _Phase.IDLE

    def received(self, size: int, now: float) -> None:
        """Bytes arrived (call before parsing them)."""
        self.last_byte = now
        if self.phase is not _Phase.BODY:
            self.unparsed_head += size

    def parsed(self) -> KvswitchError | None:
        """After parsing what arrived: a head still open past the limit (431)."""
        if self.phase is not _Phase.BODY and self.unparsed_head > self.limits.max_header_bytes:
            return self._too_large(f"the request head is over {self.limits.max_header_bytes} "
                                   "bytes (--max-header-bytes)")
        return None

    def begin(self, now: float) -> None:
        self.phase, self.since = _Phase.HEAD, now
        self.head_bytes = self.url_bytes = self.headers = 0

    def url(self, size: int) -> KvswitchError | None:
        self.url_bytes += size
        self.head_bytes += size
        if self.url_bytes > self.limits.max_url_bytes:
            return UriTooLong(f"the request target is over {self.limits.max_url_bytes} bytes "
                              "(--max-url-bytes)")
        return None

    def header(self, size: int) -> KvswitchError | None:
        self.headers += 1
        self.head_bytes += size + 4  # ": " and CRLF
        if self.headers > self.limits.max_headers:
            return self._too_large(f"the request has over {self.limits.max_headers} header "
                                   "fields (--max-headers)")
        if self.head_bytes > self.limits.max_header_bytes:
            return self._too_large(f"the request head is over {self.limits.max_header_bytes} "
                                   "bytes (--max-header-bytes)")
        return None

    def headers_done(self, now: float) -> None:
        self.phase, self.since, self.unparsed_head = _Phase.BODY, now, 0

    def complete(self, now: float) -> None:
        self.phase, self.since = _Phase.IDLE, now

    def served(self, now: float) -> None:
        """A response ended: the connection idles from now (unless a request is under way)."""
        if self.phase is _Phase.IDLE:
            self.since = now

    def expired(self, now: float) -> KvswitchError | None:
        """The 408 for a request under way that ran out of time, else None."""
        limits = self.limits
        if self.phase is _Phase.IDLE:
            return None
        if now - self.last_byte >= limits.idle_timeout:
            return RequestTimeout(f"the request was not completed within "
                                  f"{limits.idle_timeout:g} s of inactivity")
        if self.phase is _Phase.HEAD and now - self.since >= limits.head_timeout:
            return RequestTimeout(f"the request head was not received within "
                                  f"{limits.head_timeout:g} s (--head-timeout)")
        if self.phase is _Phase.BODY and now - self.since >= limits.body_timeout:
            return RequestTimeout(f"the request body was not received within "
                                  f"{limits.body_timeout:g} s (--body-timeout)")
        return None

    def idle(self, now: float) -> bool:
        """No request under way for `idle_timeout`: close quietly."""
        return self.phase is _Phase.IDLE and now - self.since >= self.limits.idle_timeout

    @staticmethod
    def _too_large(message: str) -> KvswitchError:
        return HeadersTooLarge(message)
