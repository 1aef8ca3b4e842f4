"""HTTP/1.1 test helpers for the frontend's server: a fake app, a raw request, a response reader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvswitch.errors import KvswitchError, Unavailable
from kvswitch.frontend.http_server import HttpRequest, Reply, StreamReply
from kvswitch.frontend.sse import DONE, error_reply, sse_reply


@dataclass
class FakeApp:
    """/echo answers with the method, path and body; /stream with `events`; /slow never ends."""

    events: list[bytes] = field(default_factory=lambda: [b"data: 1\n\n", b"data: 2\n\n" + DONE])
    seen: list[HttpRequest] = field(default_factory=list)
    produced: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: HttpRequest) -> Reply | StreamReply:
        self.seen.append(request)
        if request.path == "/echo":
            return Reply(200, f"{request.method} {request.path} ".encode() + request.body,
                         b"text/plain")
        if request.path == "/slow":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path in ("/stream", "/forever", "/broken"):
            return sse_reply(self._events(request.path))
        return Reply(404)

    async def _events(self, path: str) -> AsyncIterator[bytes]:
        try:
            if path == "/forever":
                while True:
                    self.produced += 1
                    yield b"data: " + b"x" * 65536 + b"\n\n"
                    await asyncio.sleep(0)
            if path == "/broken":
                yield b"data: 1\n\n"
                raise Unavailable("engine gone")
            for event in self.events:
                yield event
        finally:
            self.closed.set()

    def refuse(self, error: KvswitchError) -> Reply:
        return error_reply(error)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers, body (de-chunked)."""
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await reader.readline()).strip(), 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readline()
        return status, headers, body
    return status, headers, await reader.readexactly(int(headers.get("content-length", 0)))


def post_request(path: str, body: bytes, *extra: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in extra)
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{head}\r\n"
            ).encode() + body
