"""The chart's gateway mode over TLS: every EPP replica serves ext_proc over TLS (the Secret's
certificate, else a self-signed one; plaintext only with upstream's `secure-serving: false`),
the Service and the InferencePool's endpointPickerRef lead a Gateway to all of them, the probes
and the provider policies follow; and a real Envoy configured as a GAIE gateway configures its
EPP (one ext_proc cluster over TLS to every EPP, no access log, the EPP's pick honoured) routes
through two EPPs run with the chart's TLS flags and certificate layout."""

from __future__ import annotations

import argparse
import dataclasses
import socket
import ssl
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvswitch.envoy import GatewayOptions, PoolTarget, build_bootstrap, render
from kvswitch.envoy.clusters import EPP_CLUSTER
from kvswitch.epp import cli as epp_cli
from kvswitch.launcher import engine_spec, envoy_spec, epp_spec, write_pool_file
from kvswitch.protocol import vllm_engine_pb2_grpc as rpc
from kvswitch.supervisor import Supervisor
from kvswitch.tls import TlsFiles, UpstreamTls, envoy_upstream_tls, tls_from_args
from tests.support.chart import TLS_DIR, by_kind, secret, validate
from tests.support.chart import render as render_chart
from tests.support.gateway import generate, prompt
from tests.support.processes import free_port

GATEWAY_TLS = {"mode": "gateway", "tls": {"secretName": "qwen3-tls"},
               "router": {"epp": {"replicas": 2}}, "provider": {"name": "istio"}}


def _epp(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The EPPs' Deployment and their `epp` container."""
    (deployment,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "qwen3-epp"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


def _epp_args(container: dict[str, Any]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    epp_cli.add_arguments(parser)
    return parser.parse_args(container["args"][1:])


def test_every_epp_serves_ext_proc_over_tls_with_the_secret() -> None:
    docs = render_chart(GATEWAY_TLS)
    validate(docs)
    deployment, epp = _epp(docs)
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    # Every replica serves ext_proc with the Secret's certificate, asking none of the gateway.
    assert tls_from_args(_epp_args(epp)) == TlsFiles(Path(f"{TLS_DIR}/tls.crt"),
                                                     Path(f"{TLS_DIR}/tls.key"), None, 10.0)
    assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in epp["volumeMounts"]
    assert {"name": "tls", "secret": {"secretName": "qwen3-tls"}} in pod["spec"]["volumes"]
    # The kubelet probes the plaintext metrics port, whatever ext_proc serves.
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health"),
                        ("startupProbe", "/health")):
        assert epp[probe]["httpGet"] == {"path": path, "port": 9090}, probe
    # The pool's endpointPickerRef names a Service whose port leads to every replica's ext_proc.
    (pool,) = by_kind(docs, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    (service,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == ref["name"]]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"].get("clusterIP") != "None"
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert {"name": port["targetPort"], "containerPort": 9002, "protocol": "TCP"} in epp["ports"]
    # Istio's gateway proxy calls it over TLS (upstream's SIMPLE mode: no CA to verify with).
    (rule,) = by_kind(docs, "DestinationRule")
    assert rule["spec"]["host"] == "qwen3-epp.llm.svc.cluster.local"
    assert rule["spec"]["trafficPolicy"]["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True,
                                                    "sni": "qwen3-pool.llm.svc"}


def test_without_a_secret_tls_is_self_signed_and_secure_serving_false_is_plaintext() -> None:
    # No Secret: a certificate made at start, as upstream's EPP without --cert-path.
    docs = render_chart({**GATEWAY_TLS, "tls": {}, "provider": {"name": "gke"}})
    validate(docs)
    deployment, epp = _epp(docs)
    args = _epp_args(epp)
    assert args.tls_self_signed and tls_from_args(args) is None
    assert TLS_DIR not in yaml.safe_dump(deployment)
    # GKE's check of the EPP cannot speak TLS: /ready on the metrics port instead.
    (check,) = [p for p in by_kind(docs, "HealthCheckPolicy")
                if p["spec"]["targetRef"]["kind"] == "Service"]
    assert check["spec"]["default"]["config"] == {"type": "HTTP", "httpHealthCheck": {
        "portSpecification": "USE_FIXED_PORT", "port": 9090, "requestPath": "/ready"}}
    # Upstream's `secure-serving: false`: plaintext h2c, and the flag is the chart's, not the EPP's.
    for provider in ("istio", "gke"):
        docs = render_chart({**GATEWAY_TLS, "provider": {"name": provider},
                             "router": {"epp": {"flags": {"secure-serving": False}}}})
        validate(docs)
        _, epp = _epp(docs)
        args = _epp_args(epp)
        assert not args.tls_self_signed and tls_from_args(args) is None
        assert not any("secure-serving" in a for a in epp["args"])
    (rule,) = by_kind(render_chart({**GATEWAY_TLS, "router": {"epp": {"flags": {
        "secure-serving": "false"}}}}), "DestinationRule")
    assert rule["spec"]["trafficPolicy"]["tls"] == {"mode": "DISABLE"}


def test_the_self_signed_epp_serves_tls_a_gateway_accepts_unverified(tmp_path: Path) -> None:
    """What the chart runs without a Secret: ext_proc over TLS (ALPN h2) with a certificate
    nobody can verify, which a gateway that does not verify (upstream's default) accepts."""
    (_, container) = _epp(render_chart({**GATEWAY_TLS, "tls": {}}))
    flags = [a for a in container["args"] if a.startswith("--tls-")]
    pool = write_pool_file(tmp_path / "pool.yaml", [f"127.0.0.1:{free_port()}"])
    config = tmp_path / "epp.yaml"
    config.write_text("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n")
    supervisor = Supervisor(tmp_path)
    try:
        port = free_port()
        supervisor.start(epp_spec(config, pool, port, free_port(), flags))
        unverified = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
        unverified.set_alpn_protocols(["h2"])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                unverified.wrap_socket(raw, server_hostname="qwen3-epp.llm.svc") as tls:
            assert tls.selected_alpn_protocol() == "h2"
            assert tls.getpeercert(binary_form=True)
        verifying = ssl.create_default_context()
        verifying.set_alpn_protocols(["h2"])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                pytest.raises(ssl.SSLCertVerificationError):
            verifying.wrap_socket(raw, server_hostname="localhost")
    finally:
        supervisor.stop_all()


def test_a_self_signed_epp_refuses_certificate_files_too(tmp_path: Path) -> None:
    files = secret(tmp_path)
    argv = ["--pool", str(write_pool_file(tmp_path / "pool.yaml", ["127.0.0.1:1"])),
            "--metrics-port", "0", "--tls-self-signed"]
    for extra in (["--tls-cert", str(files / "tls.crt"), "--tls-key", str(files / "tls.key")],
                  ["--tls-client-ca", str(files / "ca.crt")]):
        assert epp_cli.main([*argv, *extra]) == 2


def _rule_with(tls: dict[str, Any]) -> dict[str, Any]:
    (rule,) = by_kind(render_chart({**GATEWAY_TLS, "provider": {"name": "istio", "istio": {
        "destinationRule": {"trafficPolicy": {"tls": tls}}}}}), "DestinationRule")
    return rule


def test_the_destination_rule_is_checked_against_istios_schema() -> None:
    # trafficPolicy.tls replaces the chart's: here, verifying the EPP against a CA.
    verifying = {"mode": "SIMPLE", "credentialName": "qwen3-epp-ca", "sni": "qwen3-epp.llm.svc"}
    rule = _rule_with(verifying)
    assert rule["spec"]["trafficPolicy"]["tls"] == verifying
    validate([rule])
    # A misspelt field or an unknown mode is refused, as the API server would.
    for tls in ({"mode": "SIMPLE", "insecureSkipVerfy": True}, {"mode": "TLS"}):
        with pytest.raises(jsonschema.ValidationError):
            validate([_rule_with(tls)])


# --- A real Envoy configured as a GAIE gateway configures its EPP, two EPPs with the chart's TLS.

@dataclasses.dataclass
class Epp:
    port: int
    metrics: int


def _gaie_gateway(bootstrap: dict[str, Any], ca: Path) -> dict[str, Any]:
    """kvswitch's bootstrap reshaped into what a GAIE gateway controller gives its Envoy: one
    ext_proc cluster over every EPP (least request, TLS verified against `ca`, no health checks),
    the EPP's pick honoured, response headers and trailers sent to the EPP and no access log to
    it (so each EPP ends a request at the end of its stream)."""
    clusters = bootstrap["static_resources"]["clusters"]
    clusters[:] = [c for c in clusters if not c["name"].startswith(f"{EPP_CLUSTER}_")]
    (epps,) = [c for c in clusters if c["name"] == EPP_CLUSTER]
    for key in ("health_checks", "outlier_detection", "common_lb_config"):
        epps.pop(key, None)
    epps["transport_socket"] = envoy_upstream_tls(UpstreamTls(ca, sni="localhost"))
    (listener,) = bootstrap["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm.pop("access_log")
    hcm["http_filters"] = [f for f in hcm["http_filters"]
                           if f["name"] != "envoy.filters.http.set_metadata"]
    (ext_proc,) = [f["typed_config"] for f in hcm["http_filters"]
                   if f["name"] == "envoy.filters.http.ext_proc"]
    ext_proc["grpc_service"] = {"envoy_grpc": {"cluster_name": EPP_CLUSTER}}
    ext_proc["processing_mode"].update(response_header_mode="SEND", response_trailer_mode="SEND")
    ext_proc.pop("metadata_options")
    return bootstrap


def _samples(epp: Epp, name: str, **labels: str) -> float:
    url = f"http://127.0.0.1:{epp.metrics}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


@pytest.fixture
def gateway_over_two_tls_epps(tmp_path: Path) -> Iterator[tuple[int, int, list[Epp]]]:
    """Two engines, two EPPs serving ext_proc with the chart's TLS flags on the chart's Secret
    layout, and the GAIE-shaped Envoy; (Envoy's port, its admin port, the EPPs)."""
    files = secret(tmp_path)
    (_, container) = _epp(render_chart(GATEWAY_TLS))
    tls_flags = [a.replace(TLS_DIR, str(files)) for a in container["args"]
                 if a.startswith("--tls-")]
    supervisor = Supervisor(tmp_path)
    try:
        endpoints = []
        for i in range(2):
            port = free_port()
            supervisor.start(engine_spec(f"engine-{i}", port, profile="tiny", time_scale=100.0,
                                         mode="echo", grace_period=1.0))
            endpoints.append(f"127.0.0.1:{port}")
        pool = write_pool_file(tmp_path / "pool.yaml", endpoints)
        config = tmp_path / "epp.yaml"
        config.write_text("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n")
        epps = [Epp(free_port(), free_port()) for _ in range(2)]
        for i, epp in enumerate(epps):
            supervisor.start(epp_spec(config, pool, epp.port, epp.metrics, tls_flags,
                                      want_ready=2, name=f"epp-{i}"))
        port, admin = free_port(), free_port()
        bootstrap = build_bootstrap(GatewayOptions(
            pool=PoolTarget(()), routing="original-dst", epp_failure_mode="FailClose",
            epps=tuple(f"127.0.0.1:{epp.port}" for epp in epps), port=port, admin_port=admin))
        envoy = tmp_path / "envoy.yaml"
        envoy.write_text(render(_gaie_gateway(bootstrap, files / "ca.crt")))
        supervisor.start(envoy_spec(envoy, admin))
        yield port, admin, epps
    finally:
        supervisor.stop_all()


def test_a_gaie_gateway_routes_through_every_tls_epp(
        gateway_over_two_tls_epps: tuple[int, int, list[Epp]]) -> None:
    port, admin, epps = gateway_over_two_tls_epps
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rpc.VllmEngineStub(channel)
        with ThreadPoolExecutor(4) as pool:
            completes = list(pool.map(lambda seed: generate(stub, prompt(seed), max_tokens=2),
                                      range(800, 840)))
    # FailClose: a request no EPP routed would have failed, not been served round robin.
    assert all(c.completion_tokens == 2 for c in completes)
    routed = [_samples(epp, "kvswitch_epp_requests_total", status="200") for epp in epps]
    assert all(r > 0 for r in routed) and sum(routed) == 40, routed

    # Each EPP ends the requests it routed at the end of their ext_proc streams (no access log).
    def finished() -> list[float]:
        return [_samples(e, "kvswitch_epp_requests_finished_total", ok="true") for e in epps]

    waiter = threading.Event()
    for _ in range(200):  # bounded: 200 x 50 ms
        if finished() == routed:
            break
        waiter.wait(0.05)
    assert finished() == routed
    # Every ext_proc connection was TLS, verified against the Secret's ca.crt.
    stat = urllib.parse.quote(f"^cluster\\.{EPP_CLUSTER}\\.ssl\\.handshake$")
    url = f"http://127.0.0.1:{admin}/stats?filter={stat}"
    with urllib.request.urlopen(url, timeout=5) as reply:
        handshakes = int(reply.read().decode().split(": ")[1])
    assert handshakes >= 2
