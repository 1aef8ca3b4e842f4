"""TLS and mTLS with certificates the test makes: `kvswitch engine` serving TLS to grpcio, and
Envoy's listener (kvswitch's bootstrap) terminating TLS for gRPC clients in front of it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from kvswitch.engine.server import EngineServer, ServerOptions
from kvswitch.envoy import EnvoyProcess, GatewayOptions, PoolTarget, build_bootstrap, render
from kvswitch.launcher import write_pool_file
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol import vllm_engine_pb2_grpc
from kvswitch.tls import TlsFiles, UpstreamTls
from kvswitch.tokenization import load_tokenizer
from tests.engine.fake_engine import FakeEngine
from tests.support.certs import Certs, make_certs
from tests.support.processes import free_port, kvswitch_argv, running

REQUEST = pb.GenerateRequest(request_id="tls", text="Hello",
                             sampling_params=pb.SamplingParams(max_tokens=3))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def credentials(certs: Certs, client: bool) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=certs.client_key.read_bytes() if client else None,
        certificate_chain=certs.client_cert.read_bytes() if client else None)


async def serve(tls: TlsFiles) -> tuple[EngineServer, int]:
    server = EngineServer(FakeEngine(), load_tokenizer(None),
                          ServerOptions(port=0, grace_period=0, tls=tls))
    return server, await server.start()


async def generate(target: str, creds: grpc.ChannelCredentials | None) -> int:
    channel = (grpc.aio.secure_channel(target, creds) if creds is not None
               else grpc.aio.insecure_channel(target))
    async with channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        messages = [m async for m in stub.Generate(REQUEST, timeout=10)]
    return messages[-1].complete.completion_tokens


@pytest.fixture
async def tls_engine(certs: Certs) -> AsyncIterator[int]:
    server, port = await serve(TlsFiles(certs.server_cert, certs.server_key))
    yield port
    await server.stop(0)


@pytest.fixture
async def mtls_engine(certs: Certs) -> AsyncIterator[int]:
    server, port = await serve(TlsFiles(certs.server_cert, certs.server_key, certs.ca))
    yield port
    await server.stop(0)


async def test_engine_serves_tls(certs: Certs, tls_engine: int) -> None:
    assert await generate(f"localhost:{tls_engine}", credentials(certs, client=False)) == 3
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # plaintext is not spoken
        await generate(f"127.0.0.1:{tls_engine}", None)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_engine_mtls_needs_a_client_certificate(certs: Certs, mtls_engine: int) -> None:
    assert await generate(f"localhost:{mtls_engine}", credentials(certs, client=True)) == 3
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(f"localhost:{mtls_engine}", credentials(certs, client=False))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.fixture
def envoy_port(certs: Certs, tmp_path: Path) -> Iterator[int]:
    """Envoy terminating mTLS in front of a plaintext engine (round robin, no EPP)."""
    engine_port, port, admin = free_port(), free_port(), free_port()
    argv = kvswitch_argv("engine", "--port", str(engine_port), "--profile", "tiny",
                         "--mode", "echo", "--time-scale", "100")
    options = GatewayOptions(pool=PoolTarget((f"127.0.0.1:{engine_port}",)), port=port,
                             admin_port=admin, round_robin=True,
                             tls=TlsFiles(certs.server_cert, certs.server_key, certs.ca))
    path = tmp_path / "envoy-tls.yaml"
    path.write_text(render(build_bootstrap(options)))
    with running(argv, engine_port, tmp_path / "engine.log"), EnvoyProcess(path, admin):
        yield port


def test_envoy_terminates_mtls_for_grpc_clients(certs: Certs, envoy_port: int) -> None:
    port = envoy_port
    with grpc.secure_channel(f"localhost:{port}", credentials(certs, client=True)) as channel:
        messages = list(vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(REQUEST,
                                                                             timeout=10))
    assert messages[-1].complete.completion_tokens == 3
    without_cert = grpc.secure_channel(f"localhost:{port}", credentials(certs, client=False))
    with without_cert as channel, pytest.raises(grpc.RpcError) as caught:
        list(vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(REQUEST, timeout=10))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_envoy_calls_the_epp_over_mtls(certs: Certs, tmp_path: Path) -> None:
    """The real Envoy routing through a `kvswitch epp` that serves only mTLS."""
    engine_port, epp_port, metrics_port, port, admin = (free_port() for _ in range(5))
    pool = write_pool_file(tmp_path / "pool.yaml", [f"127.0.0.1:{engine_port}"])
    engine = kvswitch_argv("engine", "--port", str(engine_port), "--profile", "tiny",
                           "--mode", "echo", "--time-scale", "100")
    epp = kvswitch_argv("epp", "--pool", str(pool), "--port", str(epp_port),
                        "--metrics-port", str(metrics_port), "--tls-cert", str(certs.server_cert),
                        "--tls-key", str(certs.server_key), "--tls-client-ca", str(certs.ca))
    options = GatewayOptions(pool=PoolTarget((f"127.0.0.1:{engine_port}",)),
                             epps=(f"127.0.0.1:{epp_port}",), port=port, admin_port=admin,
                             epp_tls=UpstreamTls(certs.ca, certs.client_cert, certs.client_key))
    path = tmp_path / "envoy.yaml"
    path.write_text(render(build_bootstrap(options)))
    with running(engine, engine_port, tmp_path / "engine.log"), \
            running(epp, epp_port, tmp_path / "epp.log"), EnvoyProcess(path, admin), \
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        deadline = time.monotonic() + 30
        while True:  # bounded: until the EPP has seen the engine ready
            try:
                messages = list(stub.Generate(REQUEST, timeout=10))
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                assert time.monotonic() < deadline, exc
                time.sleep(0.2)
        assert messages[-1].complete.completion_tokens == 3
        # The EPP refuses a plaintext caller, and a TLS one without a client certificate.
        with grpc.insecure_channel(f"127.0.0.1:{epp_port}") as plain, \
                pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(plain).result(timeout=2)
        no_cert = grpc.secure_channel(f"localhost:{epp_port}", credentials(certs, client=False))
        with no_cert, pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(no_cert).result(timeout=2)


def test_the_frontend_calls_its_target_over_mtls(certs: Certs, envoy_port: int,
                                                 tmp_path: Path) -> None:
    """The openai SDK -> `kvswitch frontend` -> (gRPC over mTLS) the real Envoy -> an engine."""
    import openai

    port = free_port()
    argv = kvswitch_argv("frontend", "--target", f"127.0.0.1:{envoy_port}", "--port", str(port),
                         "--target-tls-ca", str(certs.ca), "--target-tls-cert",
                         str(certs.client_cert), "--target-tls-key", str(certs.client_key))
    with running(argv, port, tmp_path / "frontend.log"):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                               max_retries=0, timeout=20)
        deadline = time.monotonic() + 30
        while True:  # bounded: the frontend reads the model from its target at start
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        completion = client.completions.create(model=model, prompt="Hello", max_tokens=3)
    assert completion.usage is not None and completion.usage.completion_tokens == 3
