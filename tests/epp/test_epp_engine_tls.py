"""The EPP calls its engines over mTLS: the load collector (GetLoads) and the KV-event
subscription against a real `kvswitch engine` that serves only mTLS, and neither gets through
without the client certificate; an HTTP pool's /metrics over HTTPS."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from kvswitch.epp.datalayer import (
    H2C,
    CollectorError,
    Datalayer,
    EndpointSpec,
    GrpcCollector,
    PrometheusCollector,
    Refresher,
    StaticDiscovery,
    default_collector,
)
from kvswitch.epp.kvindex import KvBlockIndex, KvEventSubscriber
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol import vllm_engine_pb2_grpc
from kvswitch.tls import TlsFiles, UpstreamTls, server_ssl_context
from tests.support.certs import Certs, make_certs
from tests.support.processes import free_port, kvswitch_argv, running
from tests.support.waiting import until

PROMPT = tuple(range(1000, 1070))  # 70 tokens: 4 full blocks of 16


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def engine(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    argv = kvswitch_argv("engine", "--port", str(port), "--profile", "tiny", "--time-scale", "20",
                         "--mode", "random", "--seed", "1", "--tls-cert", str(certs.server_cert),
                         "--tls-key", str(certs.server_key), "--tls-client-ca", str(certs.ca))
    with running(argv, port, tmp_path_factory.mktemp("engine") / "engine.log"):
        yield f"127.0.0.1:{port}"


def client_tls(certs: Certs) -> UpstreamTls:
    return UpstreamTls(certs.ca, certs.client_cert, certs.client_key)


async def generate(certs: Certs, address: str) -> None:
    credentials = grpc.ssl_channel_credentials(certs.ca.read_bytes(),
                                               certs.client_key.read_bytes(),
                                               certs.client_cert.read_bytes())
    port = address.rpartition(":")[2]
    async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
        request = pb.GenerateRequest(request_id="tls", tokenized=pb.TokenizedInput(
            input_ids=PROMPT), sampling_params=pb.SamplingParams(max_tokens=2))
        async for _ in vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request,
                                                                             timeout=10):
            pass


async def test_kv_events_over_mtls(certs: Certs, engine: str) -> None:
    index = KvBlockIndex(16)
    subscriber = KvEventSubscriber(engine, index, tls=client_tls(certs))
    await subscriber.start()
    try:
        await until(lambda: subscriber.connected, timeout=10)
        await generate(certs, engine)
        await until(lambda: index.match_tokens(PROMPT)[engine] == 64, timeout=10)
        await until(lambda: subscriber.load is not None)
    finally:
        await subscriber.stop()


async def test_the_refresher_collects_loads_over_mtls(certs: Certs, engine: str) -> None:
    datalayer = Datalayer()
    refresher = Refresher(datalayer, StaticDiscovery([EndpointSpec(engine, H2C)]),
                          collector_factory=lambda spec, lost: default_collector(
                              spec, lost, tls=client_tls(certs)))
    await refresher.start()
    try:
        await until(lambda: [e.address for e in datalayer.ready()] == [engine], timeout=10)
        assert datalayer.get(engine).metrics.max_tokens > 0  # type: ignore[union-attr]
    finally:
        await refresher.stop()


@pytest.mark.parametrize("tls", ["none", "no client certificate"])
async def test_without_the_client_certificate_nothing_gets_through(certs: Certs, engine: str,
                                                                  tls: str) -> None:
    collector = GrpcCollector(engine, tls=UpstreamTls(certs.ca) if tls != "none" else None)
    try:
        with pytest.raises(CollectorError):
            await collector.collect(0.0)
    finally:
        await collector.close()


def test_kvswitch_epp_takes_the_engine_tls_flags(certs: Certs) -> None:
    import argparse

    from kvswitch.epp.cli import add_arguments
    from kvswitch.tls import upstream_tls_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--engine-tls-ca", str(certs.ca), "--engine-tls-cert",
                              str(certs.client_cert), "--engine-tls-key", str(certs.client_key),
                              "--engine-tls-sni", "engine.local"])
    assert upstream_tls_from_args(args, "engine") == UpstreamTls(
        certs.ca, certs.client_cert, certs.client_key, "engine.local")


async def test_an_http_pool_is_scraped_over_https(certs: Certs) -> None:
    body = b"vllm:num_requests_running 3.0\nvllm:num_requests_waiting 2.0\n"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        writer.close()

    context = server_ssl_context(TlsFiles(certs.server_cert, certs.server_key, certs.ca),
                                 alpn="http/1.1")
    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        metrics = await PrometheusCollector(address, tls=client_tls(certs)).collect(1.0)
        assert (metrics.running, metrics.waiting) == (3, 2)
        with pytest.raises(CollectorError):  # the server wants a client certificate
            await PrometheusCollector(address, tls=UpstreamTls(certs.ca)).collect(1.0)
    finally:
        server.close()
