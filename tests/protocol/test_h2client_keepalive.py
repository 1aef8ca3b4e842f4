"""Keepalive PINGs on the HTTP/2 client: a peer that stops answering (a half-open connection)
fails the connection's calls with UNAVAILABLE within two intervals; a peer that answers keeps
an idle stream open."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from kvswitch.engine.server import GRPC_OPTIONS
from kvswitch.protocol import h2client


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    """Accepts connections and reads them, never writing a byte (an engine gone silent)."""

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            pass
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def test_a_silent_peer_fails_the_call_within_two_intervals(silent_port: int) -> None:
    channel = h2client.H2Channel([("127.0.0.1", silent_port)], keepalive=0.2)
    call = await channel.start("/x.Y/Z", (), b"", bytes, on_message=lambda m: True)
    started = time.monotonic()
    with pytest.raises(h2client.StreamError) as caught:
        await asyncio.wait_for(call.ended(), 5)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert 0.2 <= time.monotonic() - started < 1.5
    channel.close()


async def _idle_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    await asyncio.sleep(3600)
    yield b""


async def test_a_peer_that_answers_keeps_an_idle_stream_open() -> None:
    server = grpc.aio.server(options=GRPC_OPTIONS)  # permits PINGs, as kvswitch's engine does
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("x.Y", {
        "Z": grpc.unary_stream_rpc_method_handler(_idle_stream)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = h2client.H2Channel([("127.0.0.1", port)], keepalive=0.1)
    try:
        call = await channel.start("/x.Y/Z", (), b"", bytes, on_message=lambda m: True)
        ended = asyncio.ensure_future(call.ended())
        await asyncio.sleep(1.0)  # ten intervals of silence from the stream, PINGs answered
        assert not ended.done()
        call.cancel()
        ended.cancel()
    finally:
        channel.close()
        await server.stop(0)
