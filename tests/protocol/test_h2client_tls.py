"""The HTTP/2 gRPC client over TLS, against `h2` as the server: its calls say `:scheme https`
over TLS (and `http` over h2c), offer ALPN h2 and verify the server's name."""

from __future__ import annotations

import asyncio
import ssl

import h2.config
import h2.connection
import h2.events
import pytest

from kvswitch.protocol import GENERATE_PATH
from kvswitch.protocol.h2client import H2Channel, StreamError
from kvswitch.tls import TlsFiles, UpstreamTls, h2_channel_tls, server_ssl_context
from tests.support.certs import Certs, make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


async def scheme_seen(server_ssl: ssl.SSLContext | None, channel_options: dict[str, object]
                      ) -> str:
    """The `:scheme` of one call the client makes to an `h2` server (which then hangs up)."""
    seen: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        while not seen.done() and (data := await reader.read(65536)):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived) and not seen.done():
                    seen.set_result(dict(event.headers)[":scheme"])
            writer.write(conn.data_to_send())
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ssl)
    port = server.sockets[0].getsockname()[1]
    channel = H2Channel([("127.0.0.1", port)], **channel_options)  # type: ignore[arg-type]
    try:
        with pytest.raises(StreamError):  # the server never answers
            await channel.unary(GENERATE_PATH, b"", bytes, timeout=5)
        return await asyncio.wait_for(seen, 5)
    finally:
        channel.close()
        server.close()


async def test_the_scheme_is_https_over_tls(certs: Certs) -> None:
    server = server_ssl_context(TlsFiles(certs.server_cert, certs.server_key))
    client = h2_channel_tls(UpstreamTls(certs.ca))
    assert await scheme_seen(server, client) == "https"
    assert await scheme_seen(None, {}) == "http"


async def test_a_server_with_another_name_is_refused(certs: Certs) -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0,
                                        ssl=server_ssl_context(TlsFiles(certs.server_cert,
                                                                        certs.server_key)))
    port = server.sockets[0].getsockname()[1]
    channel = H2Channel([("127.0.0.1", port)],
                        **h2_channel_tls(UpstreamTls(certs.ca, sni="engine.example")))
    try:
        with pytest.raises(StreamError) as caught:
            await channel.unary(GENERATE_PATH, b"", bytes, timeout=5)
    finally:
        channel.close()
        server.close()
    assert "certificate" in caught.value.details.lower(), caught.value.details
