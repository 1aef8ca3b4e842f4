"""The /metrics HTTP server of the engine and the EPP against hostile clients: the head has a
deadline (a line every little while does not keep the connection), and over-long or too many
header lines get 431; a plain GET still works."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from kvswitch.limits import HttpLimits
from kvswitch.metrics_http import MetricsHttpServer


@pytest.fixture
async def port() -> AsyncIterator[int]:
    server = MetricsHttpServer(lambda: b"metric 1\n", lambda: True,
                               HttpLimits(head_timeout=0.5, max_headers=10))
    await server.start("127.0.0.1", 0)
    assert server._server is not None
    yield server._server.sockets[0].getsockname()[1]
    await server.stop()


async def exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.read()
    except ConnectionResetError:  # closed with our last bytes unread: the kernel sends a reset
        return b""


async def test_get_metrics(port: int) -> None:
    reply = await exchange(port, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"metric 1\n")


@pytest.mark.parametrize("head", [
    b"GET /metrics HTTP/1.1\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(11)) + b"\r\n",
    b"GET /metrics HTTP/1.1\r\nx-long: " + b"v" * 100_000 + b"\r\n\r\n",
])
async def test_oversize_heads_are_431(port: int, head: bytes) -> None:
    assert (await exchange(port, head)).startswith(b"HTTP/1.1 431")


async def test_a_head_that_never_ends_is_closed_at_the_deadline(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    closed = asyncio.ensure_future(read_until_closed(reader))
    started = time.monotonic()
    writer.write(b"GET /metrics HTTP/1.1\r\nx-slow: ")
    for _ in range(100):  # bounded: 5 s of bytes, 50 ms apart, at most
        if closed.done():
            break
        writer.write(b"v")
        await asyncio.sleep(0.05)
    assert await closed == b"" and time.monotonic() - started < 3.0
    writer.close()


async def test_health_and_ready_answer_their_own_checks() -> None:
    ready = False
    server = MetricsHttpServer(lambda: b"", lambda: True, is_ready=lambda: ready)
    await server.start("127.0.0.1", 0)
    try:
        health = await exchange(server.port, b"GET /health HTTP/1.1\r\n\r\n")
        assert health.startswith(b"HTTP/1.1 200")
        assert (await exchange(server.port, b"GET /ready HTTP/1.1\r\n\r\n")).startswith(
            b"HTTP/1.1 503")
        ready = True
        assert (await exchange(server.port, b"GET /ready HTTP/1.1\r\n\r\n")).startswith(
            b"HTTP/1.1 200")
    finally:
        await server.stop()
