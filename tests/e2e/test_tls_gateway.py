"""A gateway with every hop on TLS, started as `kvswitch up --tls-dir` starts it (certificates
the test makes): grpcio and the openai SDK through the TLS listener; Envoy reaches the EPP, the
engines and the frontend, the EPP the engines (load and KV events) and the frontend the listener,
all over mTLS; a shared prefix is still routed to the replica whose KV events announced it."""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest

from kvswitch.launcher import GatewaySpec, LaunchedGateway, launch_gateway
from kvswitch.protocol import vllm_engine_pb2_grpc as rpc
from kvswitch.supervisor import Supervisor
from kvswitch.tls_dir import TlsDir
from tests.support.certs import tls_dir
from tests.support.gateway import epp_samples, generate, prompt
from tests.support.processes import free_port


@dataclass
class TlsGateway:
    launched: LaunchedGateway
    supervisor: Supervisor
    tls: TlsDir

    @property
    def address(self) -> str:
        return f"localhost:{self.launched.ports.public}"

    def channel(self, address: str | None = None, *, client_certificate: bool = False
                ) -> grpc.Channel:
        files = self.tls.client()
        credentials = grpc.ssl_channel_credentials(
            files.ca.read_bytes(),
            files.key.read_bytes() if client_certificate and files.key else None,
            files.cert.read_bytes() if client_certificate and files.cert else None)
        return grpc.secure_channel(address or self.address, credentials)

    def engines(self) -> tuple[str, ...]:
        return self.launched.endpoints[: self.launched.spec.replicas]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsGateway]:
    tls = tls_dir(tmp_path_factory.mktemp("tls"))
    state = tmp_path_factory.mktemp("gateway")
    supervisor = Supervisor(state)
    try:
        spec = GatewaySpec(port=free_port(), replicas=2, profile="tiny", time_scale=100.0,
                           mode="echo", grace_period=1.0, frontend_workers=1, tls=tls)
        yield TlsGateway(launch_gateway(supervisor, spec, state), supervisor, tls)
    finally:
        supervisor.stop_all()


def test_grpc_through_the_tls_listener(gateway: TlsGateway) -> None:
    with gateway.channel() as channel:
        complete = generate(rpc.VllmEngineStub(channel), prompt(1), max_tokens=4)
    assert complete.completion_tokens == 4
    with grpc.insecure_channel(f"127.0.0.1:{gateway.launched.ports.public}") as plain, \
            pytest.raises(grpc.RpcError) as caught:
        generate(rpc.VllmEngineStub(plain), prompt(1), max_tokens=4)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_internal_hops_want_a_client_certificate(gateway: TlsGateway) -> None:
    engine = gateway.engines()[0]
    port = engine.rpartition(":")[2]
    with gateway.channel(f"localhost:{port}", client_certificate=True) as channel:
        assert generate(rpc.VllmEngineStub(channel), prompt(2), max_tokens=1).completion_tokens
    with gateway.channel(f"localhost:{port}") as channel, pytest.raises(grpc.RpcError) as caught:
        generate(rpc.VllmEngineStub(channel), prompt(2), max_tokens=1)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_shared_prefix_is_routed_by_kv_events(gateway: TlsGateway) -> None:
    """The EPP learns where the shared blocks are from the engines' KV events, which it reads
    over mTLS: the index counts them, and every later request with the prefix hits the cache."""
    # 16 blocks: with 4 (64 tokens) the default's charge for one running request (160 tokens)
    # outweighed the saving, and a request that had just ended but was still counted on the
    # holder when the next arrived sent that one elsewhere (about 1 run in 8).
    shared = prompt(10, blocks=16)
    # Earlier tests' prompts are indexed too: wait for this prompt's 17 blocks on top of them.
    before = sum(epp_samples(gateway, "kvswitch_epp_indexed_kv_blocks"))  # type: ignore[arg-type]
    with gateway.channel() as channel:
        stub = rpc.VllmEngineStub(channel)
        assert generate(stub, [*shared, *prompt(11, blocks=1)]).cached_tokens == 0
        deadline = time.monotonic() + 10
        while (sum(epp_samples(gateway, "kvswitch_epp_indexed_kv_blocks"))  # type: ignore[arg-type]
               < before + 17):
            assert time.monotonic() < deadline, "the EPP indexed no KV event"
            time.sleep(0.05)
        for seed in (12, 13, 14):
            again = generate(stub, [*shared, *prompt(seed, blocks=1)])
            assert again.cached_tokens >= len(shared), again


def test_the_openai_sdk_through_the_tls_listener(gateway: TlsGateway) -> None:
    context = ssl.create_default_context(cafile=gateway.tls.ca)
    with httpx.Client(verify=context, timeout=20) as http:
        client = openai.OpenAI(base_url=f"https://{gateway.address}/v1", api_key="-",
                               http_client=http, max_retries=0)
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model, max_tokens=3, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "Hello"}])
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage and usage[-1].completion_tokens == 3
