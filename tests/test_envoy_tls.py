"""Envoy to the engines and the frontends over TLS: `kvswitch envoy-config --engine-tls-*
--frontend-tls-*` in every cluster shape Envoy accepts, and the real Envoy calling an engine
that serves only mTLS."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvswitch.envoy import EnvoyProcess, GatewayOptions, PoolTarget, build_bootstrap, render
from kvswitch.envoy import run as envoy_config
from kvswitch.envoy.cli import add_arguments
from kvswitch.envoy.process import validate_config
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol import vllm_engine_pb2_grpc
from kvswitch.tls import UpstreamTls
from tests.support.certs import Certs, make_certs
from tests.support.processes import free_port, kvswitch_argv, running

REQUEST = pb.GenerateRequest(request_id="tls", text="Hello",
                             sampling_params=pb.SamplingParams(max_tokens=3))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _clusters(path: Path) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(path.read_text())["static_resources"]["clusters"]}


def _alpn(cluster: dict) -> list[str]:
    return cluster["transport_socket"]["typed_config"]["common_tls_context"]["alpn_protocols"]


@pytest.mark.parametrize("shape", [
    ["--routing", "override-host"],
    ["--routing", "original-dst"],
    ["--round-robin"],
    ["--pool-service", "engines.default.svc:8000", "--app-protocol", "http"],
])
def test_envoy_config_puts_the_engines_and_frontends_on_tls(certs: Certs, tmp_path: Path,
                                                           shape: list[str]) -> None:
    import argparse

    pool = tmp_path / "pool.yaml"
    pool.write_text("kind: InferencePool\nspec:\n  targetPorts: [{number: 8000, appProtocol: "
                    "kubernetes.io/h2c}]\n  endpoints: ['127.0.0.1:8000']\n")
    out = tmp_path / "envoy.json"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [*shape, "--frontend", "127.0.0.1:8080", "-o", str(out),
            "--engine-tls-ca", str(certs.ca), "--engine-tls-cert", str(certs.client_cert),
            "--engine-tls-key", str(certs.client_key), "--engine-tls-sni", "engine.local",
            "--frontend-tls-ca", str(certs.ca)]
    if "--pool-service" not in shape:
        argv += ["--pool", str(pool)]
    assert envoy_config(parser.parse_args(argv)) == 0
    result = validate_config(out)
    assert result.returncode == 0, result.stderr + result.stdout
    clusters = _clusters(out)
    engines, frontends = clusters["kvswitch_pool"], clusters["kvswitch_frontend"]
    assert _alpn(engines) == (["http/1.1"] if "http" in shape else ["h2"])
    assert engines["transport_socket"]["typed_config"]["sni"] == "engine.local"
    assert "tls_certificates" in engines["transport_socket"]["typed_config"]["common_tls_context"]
    assert _alpn(frontends) == ["http/1.1"]
    assert "transport_socket" not in clusters.get("kvswitch_epp", {})  # each hop on its own


@pytest.fixture(scope="module")
def mtls_engine(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    argv = kvswitch_argv("engine", "--port", str(port), "--profile", "tiny", "--mode", "echo",
                         "--time-scale", "100", "--tls-cert", str(certs.server_cert),
                         "--tls-key", str(certs.server_key), "--tls-client-ca", str(certs.ca))
    with running(argv, port, tmp_path_factory.mktemp("engine") / "engine.log"):
        yield port


@pytest.mark.parametrize("client_certificate", [True, False])
def test_envoy_calls_an_engine_over_mtls(certs: Certs, mtls_engine: int, tmp_path: Path,
                                         client_certificate: bool) -> None:
    port, admin = free_port(), free_port()
    engine_tls = (UpstreamTls(certs.ca, certs.client_cert, certs.client_key)
                  if client_certificate else UpstreamTls(certs.ca))
    options = GatewayOptions(pool=PoolTarget((f"127.0.0.1:{mtls_engine}",)), port=port,
                             admin_port=admin, round_robin=True, engine_tls=engine_tls)
    path = tmp_path / "envoy.yaml"
    path.write_text(render(build_bootstrap(options)))
    with EnvoyProcess(path, admin), grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        if client_certificate:
            messages = list(stub.Generate(REQUEST, timeout=10))
            assert messages[-1].complete.completion_tokens == 3
        else:  # the engine refuses Envoy's handshake
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(REQUEST, timeout=10))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
