"""The frontend's HTTP/1.1 server against hostile clients: oversize heads (414, 431), a header
line that never ends, slow heads and bodies sent a byte at a time (408 at the deadline),
keep-alive connections fed only blank lines, and transfer codings it cannot decode (501)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kvswitch.frontend.http_server import Server
from kvswitch.limits import HttpLimits
from tests.support.http1 import FakeApp, post_request, read_response

LIMITS = HttpLimits(max_url_bytes=1000, max_header_bytes=4000, max_headers=20,
                    head_timeout=0.5, body_timeout=0.5, idle_timeout=30.0,
                    max_body_bytes=1000)

Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


@pytest.fixture()
async def connect(request: pytest.FixtureRequest) -> AsyncIterator[Connect]:
    limits = getattr(request, "param", LIMITS)
    server = Server(FakeApp(), limits, grace_period=1.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    task = asyncio.create_task(server.serve(sock))

    async def open_() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", port)

    yield open_
    server.stop()
    await asyncio.wait_for(task, 5)


async def refused(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The refusal's status and body, and the connection closed after it."""
    status, headers, body = await asyncio.wait_for(read_response(reader), 5)
    assert headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    return status, body


async def test_a_request_within_the_limits_is_served(connect: Connect) -> None:
    reader, writer = await connect()
    head = "".join(f"x-h{i}: {'v' * 100}\r\n" for i in range(15))
    writer.write(post_request("/echo?" + "q" * 900, b"hi", head.rstrip("\r\n")))
    status, _, body = await asyncio.wait_for(read_response(reader), 5)
    assert (status, body) == (200, b"POST /echo hi")
    writer.close()


async def test_a_long_url_is_414(connect: Connect) -> None:
    reader, writer = await connect()
    writer.write(b"GET /" + b"a" * 1001 + b" HTTP/1.1\r\nhost: x\r\n\r\n")
    status, body = await refused(reader)
    assert status == 414 and b"--max-url-bytes" in body


async def test_too_many_headers_is_431(connect: Connect) -> None:
    reader, writer = await connect()
    writer.write(post_request("/echo", b"", *(f"x-h{i}: 1" for i in range(21))))
    status, body = await refused(reader)
    assert status == 431 and b"--max-headers" in body


async def test_a_large_head_in_one_piece_is_431(connect: Connect) -> None:
    reader, writer = await connect()
    writer.write(post_request("/echo", b"", "x-big: " + "v" * 5000))
    status, body = await refused(reader)
    assert status == 431 and b"--max-header-bytes" in body


async def test_a_header_line_that_never_ends_is_cut_off(connect: Connect) -> None:
    reader, writer = await connect()
    writer.write(b"GET / HTTP/1.1\r\nx-endless: ")
    sent = 0
    answered = asyncio.ensure_future(read_response(reader))
    while not answered.done() and sent < 1_000_000:  # bounded: 250 writes at most
        writer.write(b"v" * 4000)
        sent += 4000
        await asyncio.sleep(0.001)
    status, headers, _ = await asyncio.wait_for(answered, 5)
    assert status == 431 and headers["connection"] == "close"
    assert sent < 100_000  # refused near the 4,000-byte limit, not after the client gave up
    writer.close()


async def trickle(writer: asyncio.StreamWriter, data: bytes, answered: asyncio.Future[object]
                  ) -> int:
    """Write `data` a byte every 20 ms until the server answers; returns the bytes sent."""
    for sent, byte in enumerate(data):
        if answered.done():
            return sent
        writer.write(bytes([byte]))
        await asyncio.sleep(0.02)
    return len(data)


async def test_a_head_sent_a_byte_at_a_time_gets_408_at_the_head_deadline(
        connect: Connect) -> None:
    reader, writer = await connect()
    answered = asyncio.ensure_future(read_response(reader))
    started = time.monotonic()
    sent = await trickle(writer, post_request("/echo", b"hi", *("x-pad: " + "p" * 60,) * 10),
                         answered)
    status, _, body = await asyncio.wait_for(answered, 5)
    assert status == 408 and b"--head-timeout" in body
    assert sent < 700 and time.monotonic() - started < 3.0  # the head was still coming
    writer.close()


async def test_a_body_sent_a_byte_at_a_time_gets_408_at_the_body_deadline(
        connect: Connect) -> None:
    reader, writer = await connect()
    writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 900\r\n\r\n")
    answered = asyncio.ensure_future(read_response(reader))
    started = time.monotonic()
    sent = await trickle(writer, b"b" * 900, answered)
    status, _, body = await asyncio.wait_for(answered, 5)
    assert status == 408 and b"--body-timeout" in body
    assert sent < 900 and time.monotonic() - started < 3.0
    writer.close()


@pytest.mark.parametrize("connect", [HttpLimits(idle_timeout=0.5, head_timeout=0.5)],
                         indirect=True)
async def test_blank_lines_do_not_keep_an_idle_connection_open(connect: Connect) -> None:
    reader, writer = await connect()
    closed = asyncio.ensure_future(reader.read())
    started = time.monotonic()
    for _ in range(250):  # bounded: 5 s of blank lines at most
        if closed.done():
            break
        writer.write(b"\r\n")
        await asyncio.sleep(0.02)
    assert closed.done() and time.monotonic() - started < 3.0
    writer.close()


@pytest.mark.parametrize("coding", ["gzip, chunked", "deflate,chunked", "gzip"])
async def test_a_transfer_coding_other_than_chunked_is_501(connect: Connect,
                                                           coding: str) -> None:
    reader, writer = await connect()
    writer.write(f"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: {coding}\r\n\r\n"
                 "5\r\nhello\r\n0\r\n\r\n".encode())
    status, body = await refused(reader)
    assert status == 501 and b"transfer-encoding" in body
