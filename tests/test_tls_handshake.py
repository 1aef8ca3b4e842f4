"""The TLS handshake deadline (`--tls-handshake-timeout`): every TLS server kvswitch runs (the
EPP's h2 and grpcio transports, the engine, the frontend, Envoy's listener) drops a client that
opens TCP and never finishes its handshake, and still serves one that does."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from kvswitch.engine.server import EngineServer, ServerOptions
from kvswitch.envoy import EnvoyProcess, GatewayOptions, PoolTarget, build_bootstrap, render
from kvswitch.epp.config import build_endpoint_picker, static_pool
from kvswitch.epp.h2server import H2GrpcServer
from kvswitch.epp.server import EppServer
from kvswitch.frontend.http_server import Server
from kvswitch.limits import HTTP_DEFAULTS
from kvswitch.tls import TlsFiles, server_ssl_context
from kvswitch.tokenization import load_tokenizer
from tests.engine.fake_engine import FakeEngine
from tests.support.certs import Certs, make_certs
from tests.support.processes import free_port

DEADLINE = 0.5
# How long a silent client waits to be dropped: well past DEADLINE, far below the defaults the
# servers fall back to without one (asyncio 60 s, grpc 120 s, Envoy none).
PATIENCE = 8.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls(certs: Certs) -> TlsFiles:
    return TlsFiles(certs.server_cert, certs.server_key, handshake_timeout=DEADLINE)


async def dropped_within(port: int, patience: float = PATIENCE) -> float:
    """Connect, send nothing, and return how long the server took to close the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(), patience)
    except TimeoutError:
        pytest.fail(f"the server kept a silent TLS client for {patience} s")
    except ConnectionResetError:
        data = b""
    finally:
        writer.close()
    assert data == b"", data  # no handshake ever began: nothing to say but the close
    return time.monotonic() - started


async def handshake(port: int, certs: Certs, alpn: str) -> str | None:
    """A full handshake (after another client sat silent); returns the negotiated ALPN."""
    context = ssl.create_default_context(cafile=certs.ca)
    context.set_alpn_protocols([alpn])
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context,
                                              server_hostname="localhost")
    try:
        return writer.get_extra_info("ssl_object").selected_alpn_protocol()
    finally:
        writer.close()


async def test_the_epp_h2_server_drops_a_silent_tls_client(certs: Certs) -> None:
    server = H2GrpcServer({}, ssl=server_ssl_context(tls(certs)), ssl_handshake_timeout=DEADLINE)
    port = await server.start()
    try:
        assert await dropped_within(port) < PATIENCE
        assert await handshake(port, certs, "h2") == "h2"
    finally:
        await server.stop(0)


async def test_the_epp_grpcio_transport_drops_a_silent_tls_client(certs: Certs) -> None:
    picker = build_endpoint_picker(None, static_pool(["127.0.0.1:1"]))
    server = EppServer(picker, port=0, transport="grpcio", tls=tls(certs))
    port = await server.start()
    try:
        assert await dropped_within(port) < PATIENCE
    finally:
        await server.stop(0)


@pytest.fixture
async def engine_port(certs: Certs) -> AsyncIterator[int]:
    server = EngineServer(FakeEngine(), load_tokenizer(None),
                          ServerOptions(port=0, grace_period=0, tls=tls(certs)))
    yield await server.start()
    await server.stop(0)


async def test_the_engine_drops_a_silent_tls_client(certs: Certs, engine_port: int) -> None:
    assert await dropped_within(engine_port) < PATIENCE
    credentials = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    async with grpc.aio.secure_channel(f"localhost:{engine_port}", credentials) as channel:
        await asyncio.wait_for(channel.channel_ready(), 10)


class _NoRequests:
    async def handle(self, request: object) -> object:
        raise AssertionError("no request reaches the app in these tests")


async def test_the_frontend_drops_a_silent_tls_client(certs: Certs) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    server = Server(_NoRequests(), HTTP_DEFAULTS,  # type: ignore[arg-type]
                    ssl=server_ssl_context(tls(certs), alpn="http/1.1"),
                    ssl_handshake_timeout=DEADLINE)
    serving = asyncio.create_task(server.serve(sock))
    try:
        assert await dropped_within(port) < PATIENCE
        assert await handshake(port, certs, "http/1.1") == "http/1.1"
    finally:
        server.stop()
        await serving


@pytest.fixture
def envoy_port(certs: Certs, tmp_path: Path) -> Iterator[int]:
    port, admin = free_port(), free_port()
    options = GatewayOptions(pool=PoolTarget(("127.0.0.1:1",)), port=port, admin_port=admin,
                             round_robin=True, tls=tls(certs))
    path = tmp_path / "envoy.yaml"
    path.write_text(render(build_bootstrap(options)))
    with EnvoyProcess(path, admin):
        yield port


async def test_envoy_drops_a_silent_tls_client(certs: Certs, envoy_port: int) -> None:
    assert await dropped_within(envoy_port) < PATIENCE
    assert await handshake(envoy_port, certs, "h2") == "h2"
