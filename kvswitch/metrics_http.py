"""The /metrics and /health HTTP server of the engine and the EPP: one small asyncio server.

GET (or HEAD) /metrics answers `render()` as Prometheus text; /health answers 200 "ok" while
`is_healthy()`, else 503, and /ready the same with `is_ready()` (default: `is_healthy`; the
kubelet's probes use them where its gRPC probe cannot go, e.g. a TLS port); any other path is
404, any other method 405. One request per
connection (`Connection: close`). The whole request head must arrive within
`HttpLimits.head_timeout` in at most `max_headers` lines of at most 64 KiB (else the connection
closes, or 431), so slow or endless clients cost a coroutine each, never a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvswitch.limits import HTTP_DEFAULTS, HttpLimits

__all__ = ["CONTENT_TYPE", "MetricsHttpServer"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsHttpServer:
    """GET /metrics and GET /health over HTTP/1.1 on asyncio streams, one request per
    connection; deliberately tiny so neither process carries a web framework."""

    def __init__(self, render_metrics: Callable[[], bytes], is_healthy: Callable[[], bool],
                 limits: HttpLimits = HTTP_DEFAULTS, *,
                 is_ready: Callable[[], bool] | None = None):
        self._render = render_metrics
        self._healthy = is_healthy
        self._ready = is_ready if is_ready is not None else is_healthy
        self._limits = limits
        self._server: asyncio.Server | None = None
        self.port = 0
        """The bound port, once started."""

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                method, path = await self._read_head(reader)
                status, ctype, body = self._respond(method, path)
            except ValueError:  # a line over the reader's 64 KiB, or too many of them
                method, status, ctype, body = ("", "431 Request Header Fields Too Large",
                                               "text/plain", b"request head too large\n")
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
            writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[str, str]:
        """The request's method and path; the whole head within `HttpLimits.head_timeout` and
        `max_headers` lines (TimeoutError, ValueError)."""
        async with asyncio.timeout(self._limits.head_timeout):
            request_line = await reader.readline()
            for _ in range(self._limits.max_headers + 1):
                if await reader.readline() in (b"\r\n", b"\n", b""):
                    break
            else:
                raise ValueError("too many header lines")
        parts = request_line.decode("latin-1").split()
        return (parts[0], parts[1].split("?", 1)[0]) if len(parts) >= 2 else ("", "")

    def _respond(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"method not allowed\n"
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE, self._render()
        if path == "/health":
            if self._healthy():
                return "200 OK", "text/plain", b"ok\n"
            return "503 Service Unavailable", "text/plain", b"unhealthy\n"
        if path == "/ready":
            if self._ready():
                return "200 OK", "text/plain", b"ready\n"
            return "503 Service Unavailable", "text/plain", b"not ready\n"
        return "404 Not Found", "text/plain", b"not found\n"
