"""Fuzz targets for the transports: the EPP's HTTP/2 server, the HTTP/2 gRPC client and the
frontend's HTTP/1.1 server, each fed frames or requests that are well-formed, cut or mutated."""

from __future__ import annotations

import asyncio

from hypothesis import strategies as st

from kvswitch.epp import h2connection
from kvswitch.errors import KvswitchError
from kvswitch.frontend.http_server import HttpRequest, Reply, Server, _Connection
from kvswitch.limits import HttpLimits
from kvswitch.protocol import (
    GENERATE_PATH,
    h2client,  # the HTTP/2 client under test: its one import here
)
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.http2 import PREFACE, frame, hpack_literal
from tests.fuzz.base import FakeTransport, Target, mutated
from tests.fuzz.raw import Codec

_SPLIT = Codec("bytes", (255,))  # the first byte: where the input is cut in two

__all__ = ["H2_CLIENT", "H2_SERVER", "HTTP1"]


# ---- HTTP/2 frames -------------------------------------------------------------------------

_frame = st.builds(
    lambda kind, flags, sid, payload: frame(kind, flags, sid, payload),
    st.integers(0, 11), st.sampled_from([0, 1, 4, 5, 8, 0x20, 0x2D, 255]),
    st.sampled_from([0, 1, 3, 5, 2, 2**31 - 1]), st.binary(max_size=40))
_PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
_request_headers = st.just(frame(1, 4, 1, b"".join(hpack_literal(k, v) for k, v in (
    (":method", "POST"), (":scheme", "http"), (":path", _PROCESS),
    ("content-type", "application/grpc"), ("te", "trailers")))))
_h2_input = st.lists(st.one_of(_frame, _request_headers, mutated(_frame)), max_size=8).map(
    b"".join)


def _frames_out(data: bytes) -> list[int]:
    """The types of the frames in `data`, which must be whole, well-formed frames."""
    kinds, offset = [], 0
    while offset < len(data):
        length = int.from_bytes(data[offset:offset + 3], "big")
        assert offset + 9 + length <= len(data), "a frame written in part"
        kinds.append(data[offset + 3])
        offset += 9 + length
    return kinds


def check_h2_server(args: tuple[bytes, int]) -> None:
    data, split = args
    conn = h2connection.H2GrpcConnection(max_message_bytes=1 << 16)
    conn.initiate()
    out = conn.data_to_send()
    stream = PREFACE + frame(4, 0, 0) + data
    for piece in (stream[:split], stream[split:]):
        events = conn.receive(piece)  # never raises
        assert all(isinstance(e, h2connection.Event) for e in events)
        out += conn.data_to_send()
    kinds = _frames_out(out)
    if conn.closed:
        assert 7 in kinds  # GOAWAY says why
        assert conn.receive(b"\x00" * 9) == []  # and nothing more is read


H2_SERVER = Target("h2-server", st.tuples(_h2_input, st.integers(0, 80)), check_h2_server,
                   _SPLIT)


def check_h2_client(args: tuple[bytes, int]) -> None:
    data, split = args

    async def run() -> None:
        conn = h2client._Connection("test:1")
        transport = FakeTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        call = conn.start(GENERATE_PATH, (), b"x", pb.GenerateResponse.FromString)
        response = frame(1, 4, 1, hpack_literal(":status", "200")
                         + hpack_literal("content-type", "application/grpc"))
        stream = frame(4, 0, 0) + response + data
        conn.data_received(stream[:split])
        conn.data_received(stream[split:])
        conn.connection_lost(None)
        try:
            await asyncio.wait_for(call.read_batch(), 1)
        except h2client.StreamError:
            pass
        except asyncio.CancelledError:
            raise
        written = b"".join(transport.out)
        assert written.startswith(PREFACE)
        _frames_out(written[len(PREFACE):])

    asyncio.run(run())


H2_CLIENT = Target("h2-client", st.tuples(_h2_input, st.integers(0, 80)), check_h2_client,
                   _SPLIT)


# ---- HTTP/1.1 requests (the frontend's server) ---------------------------------------------

_REFUSALS = {400, 408, 413, 414, 431, 501, 503}
_http_request = st.builds(
    lambda method, target, headers, body: (
        f"{method} {target} HTTP/1.1\r\n".encode() + b"".join(
            f"{k}: {v}\r\n".encode() for k, v in headers) + b"\r\n" + body),
    st.sampled_from(["GET", "POST", "HEAD", "PUT", "X"]),
    st.sampled_from(["/echo", "/", "/v1/x?y=1", "*", "/" + "a" * 300]),
    st.lists(st.tuples(st.sampled_from(["content-length", "transfer-encoding", "host",
                                        "expect", "connection", "x-a"]),
                       st.sampled_from(["0", "5", "chunked", "gzip, chunked", "100-continue",
                                        "close", "-1", "99999999999", "a" * 200])),
             max_size=5),
    st.binary(max_size=40))
_http_input = st.lists(mutated(_http_request), min_size=1, max_size=3).map(b"".join)


def check_http1(args: tuple[bytes, int]) -> None:
    data, split = args

    class App:
        async def handle(self, request: HttpRequest) -> Reply:
            return Reply(200, request.body)

        def refuse(self, error: KvswitchError) -> Reply:
            return Reply(error.http_status, error.message.encode())

    async def run() -> bytes:
        server = Server(App(), HttpLimits(max_url_bytes=200, max_header_bytes=400,
                                          max_headers=4, max_body_bytes=30))
        conn = _Connection(server)
        transport = FakeTransport()
        transport.pause_reading = transport.resume_reading = (  # type: ignore[attr-defined]
            lambda: None)
        transport.can_write_eof = lambda: False  # type: ignore[attr-defined]
        conn.connection_made(transport)  # type: ignore[arg-type]
        conn.data_received(data[:split])
        conn.data_received(data[split:])
        for _ in range(20):  # let the queued requests be served (bounded)
            await asyncio.sleep(0)
        conn.connection_lost(None)
        await asyncio.sleep(0)
        return b"".join(transport.out)

    out = asyncio.run(run())
    for line in out.split(b"\r\n"):
        if line.startswith(b"HTTP/1.1 ") and line[9:12].isdigit():
            status = int(line[9:12])
            assert status in _REFUSALS | {100, 200}, line


HTTP1 = Target("http1-requests", st.tuples(_http_input, st.integers(0, 200)), check_http1,
               _SPLIT)
