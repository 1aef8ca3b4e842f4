"""The frontend's HTTP/1.1 server on loopback, with a fake app and raw sockets: keep-alive,
pipelining, chunked uploads, refusals (413, 400), streams, backpressure, disconnects, stop."""

from __future__ import annotations

import asyncio
import email.utils
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kvswitch.frontend.http_server import Server
from kvswitch.frontend.sse import DONE
from kvswitch.limits import HttpLimits
from tests.support.http1 import FakeApp, post_request, read_response

Client = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


@pytest.fixture()
async def served() -> AsyncIterator[tuple[FakeApp, Server, Client]]:
    app = FakeApp()
    server = Server(app, HttpLimits(max_body_bytes=1000), grace_period=2.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    task = asyncio.create_task(server.serve(sock))

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", port)

    await asyncio.sleep(0.01)
    yield app, server, connect
    server.stop()
    await asyncio.wait_for(task, 5)


async def test_keep_alive_serves_requests_one_after_another(served) -> None:
    app, _, connect = served
    reader, writer = await connect()
    for i in range(3):
        writer.write(post_request("/echo?q=1", b"body %d" % i))
        status, headers, body = await read_response(reader)
        headers.pop("date")
        assert (status, headers, body) == (200, {"content-type": "text/plain",
                                                 "content-length": "17"}, b"POST /echo body %d" % i)
    assert [r.path for r in app.seen] == ["/echo"] * 3
    writer.close()


async def test_pipelined_requests_are_answered_in_order(served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(post_request("/stream", b"") + post_request("/echo", b"second")
                 + b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
    assert (await read_response(reader))[2] == b"data: 1\n\ndata: 2\n\n" + DONE
    assert (await read_response(reader))[2] == b"POST /echo second"
    assert (await read_response(reader))[2] == b"GET /echo "
    writer.close()


async def test_chunked_upload_is_decoded(served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                 b"5\r\nhello\r\n")
    await asyncio.sleep(0.05)
    writer.write(b"6\r\n world\r\n0\r\n\r\n")
    assert (await read_response(reader))[2] == b"POST /echo hello world"
    writer.close()


@pytest.mark.parametrize("chunked", [False, True])
async def test_oversize_body_is_413_then_close(served, chunked: bool) -> None:
    app, _, connect = served
    reader, writer = await connect()
    if chunked:
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                     + b"200\r\n" + b"x" * 512 + b"\r\n" + b"200\r\n" + b"x" * 512 + b"\r\n")
    else:
        writer.write(post_request("/echo", b"x" * 1001))
    status, headers, body = await read_response(reader)
    assert status == 413 and headers["connection"] == "close"
    assert b"PayloadTooLarge" in body or b"over the limit" in body
    assert await reader.read() == b""  # closed
    assert app.seen == []


async def test_oversize_after_a_pipelined_request_waits_its_turn(served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(post_request("/echo", b"first") + post_request("/echo", b"x" * 2000))
    assert (await read_response(reader))[:1] == (200,)
    assert (await read_response(reader))[0] == 413
    assert await reader.read() == b""


@pytest.mark.parametrize("request_line", [b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9 x\r\n\r\n",
                                          b"POST /echo HTTP/1.1\r\ncontent-length: x\r\n\r\n"])
async def test_malformed_request_is_400_then_close(served, request_line: bytes) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(request_line)
    status, headers, _ = await read_response(reader)
    assert status == 400 and headers["connection"] == "close"
    assert await reader.read() == b""


async def test_connection_close_and_http10_close_after_the_response(served) -> None:
    _, _, connect = served
    for request in (post_request("/echo", b"a", "connection: close"),
                    b"GET /echo HTTP/1.0\r\n\r\n"):
        reader, writer = await connect()
        writer.write(request)
        status, headers, _ = await read_response(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await reader.read() == b""


async def test_stream_is_chunked_sse(served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(post_request("/stream", b"{}"))
    status, headers, body = await read_response(reader)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert body == b"data: 1\n\ndata: 2\n\n" + DONE


async def test_stream_error_after_200_is_in_band(served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(post_request("/broken", b""))
    status, _, body = await read_response(reader)
    assert status == 200
    assert body.startswith(b"data: 1\n\ndata: {\"error\"") and body.endswith(DONE)
    assert b"ServiceUnavailableError" in body


async def test_disconnect_mid_stream_closes_the_iterator(served) -> None:
    app, _, connect = served
    reader, writer = await connect()
    writer.write(post_request("/forever", b""))
    await reader.readexactly(1000)
    writer.transport.abort()
    await asyncio.wait_for(app.closed.wait(), 5)


async def test_disconnect_while_waiting_cancels_the_handler(served) -> None:
    app, _, connect = served
    _, writer = await connect()
    writer.write(post_request("/slow", b""))
    while not app.seen:
        await asyncio.sleep(0.01)
    writer.close()
    await asyncio.wait_for(app.cancelled.wait(), 5)


async def test_slow_reader_pauses_the_stream(served) -> None:
    app, _, connect = served
    reader, writer = await connect()
    writer.transport.pause_reading()
    writer.write(post_request("/forever", b""))
    # The socket buffers fill first (how fast depends on the machine's load): wait until the
    # stream stops producing (unchanged over three looks, so that a loaded machine's pause is
    # not taken for it), then check that it stays stopped.
    held, still = -1, 0
    for _ in range(50):
        await asyncio.sleep(0.1)
        still = still + 1 if app.produced == held else 0
        if still == 3:
            break
        held = app.produced
    await asyncio.sleep(0.3)
    assert app.produced == held < 500  # waiting for the client, not buffering without bound
    writer.transport.resume_reading()
    # It resumes once the client has drained what the sockets hold, which TCP autotuning sizes
    # (several MB after a busy test run): read until it does, at most 64 MB.
    for _ in range(1024):
        await reader.readexactly(65536)
        if app.produced > held:
            break
    assert app.produced > held
    writer.transport.abort()
    await asyncio.wait_for(app.closed.wait(), 5)


async def test_stop_lets_a_stream_in_flight_finish(served) -> None:
    app, server, connect = served
    app.events = [b"data: 1\n\n", b"data: 2\n\n" + DONE]
    reader, writer = await connect()
    idle_reader, _ = await connect()
    writer.write(post_request("/stream", b""))
    while not app.seen:
        await asyncio.sleep(0.001)
    server.stop()
    status, _, body = await read_response(reader)
    assert status == 200 and body.endswith(DONE)
    assert await idle_reader.read() == b""  # idle connections are closed at once


async def test_http10_stream_is_not_chunked_and_ends_with_the_connection(served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(b"POST /stream HTTP/1.0\r\ncontent-length: 0\r\n\r\n")
    head, _, body = (await reader.read()).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head
    assert b"connection: close" in head
    assert body == b"data: 1\n\ndata: 2\n\n" + DONE


async def test_head_gets_headers_without_the_body(served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(b"HEAD /echo HTTP/1.1\r\nhost: x\r\n\r\n" + post_request("/echo", b"next"))
    head = await reader.readuntil(b"\r\n\r\n")
    assert re.fullmatch(
        rb"HTTP/1.1 200 OK\r\ndate: [^\r]+\r\ncontent-type: text/plain\r\n"
        rb"content-length: 11\r\n\r\n",
        head)  # the length of "HEAD /echo ", and no body
    assert (await read_response(reader))[2] == b"POST /echo next"


async def test_every_response_carries_the_current_date(served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    for request in (post_request("/echo", b""), post_request("/stream", b"{}")):
        writer.write(request)
        _, headers, _ = await read_response(reader)
        sent = email.utils.parsedate_to_datetime(headers["date"])
        assert sent.tzinfo is not None
        assert abs(sent.timestamp() - time.time()) < 5
    writer.close()


async def test_a_request_stalled_half_way_gets_408_then_close() -> None:
    server = Server(FakeApp(), HttpLimits(max_body_bytes=1000, idle_timeout=0.3))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    task = asyncio.create_task(server.serve(sock))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        writer.write(post_request("/echo", b"ab") + post_request("/echo", b"0123456789")[:-4])
        status, _, body = await asyncio.wait_for(read_response(reader), 5)
        assert (status, body) == (200, b"POST /echo ab")  # the complete one is served
        status, headers, body = await asyncio.wait_for(read_response(reader), 5)
        assert status == 408 and headers["connection"] == "close"
        assert b"inactivity" in body
        assert await asyncio.wait_for(reader.read(), 5) == b""
        idle_reader, _ = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        assert await asyncio.wait_for(idle_reader.read(), 5) == b""  # idle: closed silently
    finally:
        server.stop()
        await asyncio.wait_for(task, 5)


async def test_stop_answers_a_half_received_request_with_503(served) -> None:
    _, server, connect = served
    reader, writer = await connect()
    writer.write(post_request("/echo", b"0123456789")[:-4])
    await asyncio.sleep(0.05)
    server.stop()
    status, headers, body = await asyncio.wait_for(read_response(reader), 5)
    assert status == 503 and headers["connection"] == "close"
    assert b"shutting down" in body
