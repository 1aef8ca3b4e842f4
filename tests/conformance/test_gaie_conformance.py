"""The EPP-and-proxy half of the Gateway API Inference Extension conformance suite, without a
cluster: real Envoy (kvswitch's bootstrap), real EPP and `kvswitch engine` processes on loopback.

Upstream's tests (conformance/tests/ in gateway-api-inference-extension) and their analogues:
- GatewayFollowingEPPRouting: every request is served by the endpoint the EPP picked (the EPP's
  debug log names its pick; the gateway reports the replica that served it);
- GatewayDestinationEndpointServed: the gateway reports the served endpoint, and it is the one
  the EPP was restricted to (the subset hint stands in for upstream's test header);
- EppUnAvailableFailOpen: with the EPP gone, FailOpen still serves and FailClose answers
  UNAVAILABLE;
- InferencePoolAppProtocol: an h2c pool is reached over HTTP/2 only, an `http` pool and one
  without appProtocol over HTTP/1.1 only;
- the same routing against the pod set Kubernetes discovery builds from the API server double,
  following a pod that turns unready and back.
The engines listen on 127.0.0.2 and 127.0.0.3 at one port, as pods share their target port.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvswitch.envoy import GatewayOptions, PoolTarget, build_bootstrap, read_pool, render
from kvswitch.envoy.clusters import EPP_CLUSTER
from kvswitch.launcher import (
    engine_spec,
    envoy_spec,
    epp_pool_ready,
    epp_spec,
    kvswitch_argv,
    write_pool_file,
)
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol import vllm_engine_pb2_grpc as rpc
from kvswitch.protocol.headers import DESTINATION_SUBSET, SERVED_ENDPOINT
from kvswitch.supervisor import ChildSpec, Supervisor, port_open
from tests.e2e.test_http_pool import CONFIG as HTTP_CONFIG
from tests.e2e.test_http_pool import _ModelServer as HttpModelServer
from tests.support.kube_api import ThreadedKubeApi, inference_pool, pod
from tests.support.processes import free_port

HOSTS = ("127.0.0.2", "127.0.0.3")
CALL_TIMEOUT = 20.0
CONFIG = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig"}


@dataclasses.dataclass
class Pool:
    supervisor: Supervisor
    tmp: Path
    port: int

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(f"{host}:{self.port}" for host in HOSTS)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """Two tiny echo engines, one per loopback 'pod IP', on the same port."""
    tmp = tmp_path_factory.mktemp("conformance")
    port = free_port()
    supervisor = Supervisor(tmp)
    try:
        for i, host in enumerate(HOSTS):
            spec = engine_spec(f"engine-{i}", port, profile="tiny", time_scale=100.0,
                               mode="echo", grace_period=1.0, extra=("--host", host))
            supervisor.start(dataclasses.replace(spec, ready=port_open(port, host)))
        yield Pool(supervisor, tmp, port)
    finally:
        supervisor.stop_all()


def _envoy(pool: Pool, name: str, epp_port: int, **options: object) -> tuple[int, int]:
    """Start an Envoy in front of the pool; its (public, admin) ports."""
    port, admin = free_port(), free_port()
    config = pool.tmp / f"{name}.yaml"
    target: Any = options.pop("target", PoolTarget(pool.endpoints))
    extra: Any = options
    config.write_text(render(build_bootstrap(GatewayOptions(
        pool=target, epps=(f"127.0.0.1:{epp_port}",), port=port, admin_port=admin,
        report_served_endpoint=True, **extra))))
    pool.supervisor.start(dataclasses.replace(envoy_spec(config, admin), name=name))
    return port, admin


def _epp_marked_down(admin: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/clusters", timeout=5) as reply:
        text = reply.read().decode()
    return any(line.startswith(f"{EPP_CLUSTER}::") and "failed_active_hc" in line
               for line in text.splitlines())


def _epp_file(pool: Pool, name: str) -> tuple[int, str]:
    """An EPP on the pool file; (its port, its child's name)."""
    pool_file = write_pool_file(pool.tmp / f"{name}-pool.yaml", pool.endpoints)
    config = pool.tmp / f"{name}-epp.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    port, metrics = free_port(), free_port()
    spec = epp_spec(config, pool_file, port, metrics, ("--log-level", "debug"),
                    want_ready=len(HOSTS))
    pool.supervisor.start(dataclasses.replace(spec, name=name))
    return port, name


def _generate(port: int, seed: int, metadata: tuple[tuple[str, str], ...] = ()
              ) -> tuple[grpc.StatusCode, str, str]:
    """One Generate through the gateway: (status, served endpoint, request id)."""
    request_id = f"conf-{os.getpid()}-{port}-{seed}-{time.monotonic_ns()}"
    request = pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=[1000 + (seed * 7919 + i) % 50000
                                               for i in range(64)]),
        sampling_params=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = rpc.VllmEngineStub(channel).Generate(
            request, metadata=(("x-request-id", request_id), *metadata), timeout=CALL_TIMEOUT)
        try:
            responses = list(call)
        except grpc.RpcError as error:
            return error.code(), "", request_id
        assert any(r.HasField("complete") for r in responses)
        served = dict(call.initial_metadata()).get(SERVED_ENDPOINT, "")
        return grpc.StatusCode.OK, str(served), request_id


def _epp_pick(supervisor: Supervisor, name: str, request_id: str) -> str:
    """The endpoint the EPP's debug log says it picked for `request_id` (waits for the line)."""
    pattern = re.compile(rf"request {re.escape(request_id)} \S+ -> 200 (\S+)")
    deadline = time.monotonic() + 10
    while not (match := pattern.search(supervisor.get(name).tail(1_000_000))):
        assert time.monotonic() < deadline, f"no routing line for {request_id}"
        time.sleep(0.02)
    return match.group(1).split(",")[0]


def test_gateway_follows_the_epps_pick(pool: Pool) -> None:
    """GatewayFollowingEPPRouting and InferencePoolAppProtocol (h2c)."""
    epp_port, epp = _epp_file(pool, "epp-follow")
    port, admin = _envoy(pool, "envoy-follow", epp_port)
    served = set()
    for seed in range(12):
        status, endpoint, request_id = _generate(port, seed)
        assert status == grpc.StatusCode.OK
        assert endpoint == _epp_pick(pool.supervisor, epp, request_id)
        served.add(endpoint)
    assert served <= set(pool.endpoints) and served
    # appProtocol kubernetes.io/h2c: Envoy reached the pool over HTTP/2 only.
    url = f"http://127.0.0.1:{admin}/stats?filter=kvswitch_pool.upstream_cx_http"
    with urllib.request.urlopen(url, timeout=5) as reply:
        stats = dict(line.split(": ") for line in reply.read().decode().splitlines())
    assert int(stats["cluster.kvswitch_pool.upstream_cx_http2_total"]) >= 1
    assert int(stats["cluster.kvswitch_pool.upstream_cx_http1_total"]) == 0


def test_gateway_reports_the_served_endpoint(pool: Pool) -> None:
    """GatewayDestinationEndpointServed: each endpoint the EPP is limited to serves, and the
    gateway says so."""
    epp_port, _ = _epp_file(pool, "epp-served")
    port, _ = _envoy(pool, "envoy-served", epp_port)
    for seed, endpoint in enumerate(pool.endpoints * 2):
        status, served, _ = _generate(port, 100 + seed, ((DESTINATION_SUBSET, endpoint),))
        assert (status, served) == (grpc.StatusCode.OK, endpoint)


def test_epp_unavailable_fail_open_and_fail_close(pool: Pool) -> None:
    """EppUnAvailableFailOpen, and its FailClose counterpart."""
    epp_port, epp = _epp_file(pool, "epp-failure")
    fail_open, admin = _envoy(pool, "envoy-fail-open", epp_port, epp_failure_mode="FailOpen")
    fail_close, _ = _envoy(pool, "envoy-fail-close", epp_port, epp_failure_mode="FailClose")
    for port in (fail_open, fail_close):
        assert _generate(port, 200)[0] == grpc.StatusCode.OK
    os.kill(pool.supervisor.get(epp).pid, signal.SIGKILL)
    pool.supervisor.get(epp).proc.wait(timeout=10)
    # FailOpen Envoy health-checks the EPP every second; once it knows, requests bypass it.
    deadline = time.monotonic() + 10
    while not _epp_marked_down(admin):
        assert time.monotonic() < deadline, "Envoy never marked the EPP down"
        time.sleep(0.05)
    for seed in range(4):
        status, served, _ = _generate(fail_open, 210 + seed)
        assert status == grpc.StatusCode.OK and served in pool.endpoints
        assert _generate(fail_close, 220 + seed)[0] == grpc.StatusCode.UNAVAILABLE


def _until_served(port: int, endpoint: str, expect: grpc.StatusCode) -> None:
    deadline = time.monotonic() + 10
    seed = 300
    while (result := _generate(port, seed, ((DESTINATION_SUBSET, endpoint),)))[0] != expect:
        assert time.monotonic() < deadline, f"{endpoint}: still {result}"
        seed += 1
        time.sleep(0.05)
    if expect == grpc.StatusCode.OK:
        assert result[1] == endpoint


def test_routing_over_the_pod_set_discovery_builds(pool: Pool) -> None:
    """The EPP on Kubernetes discovery (the API server double) behind an Envoy that routes to
    whatever ip:port the EPP names (ORIGINAL_DST, as a pool of pods needs)."""
    api = ThreadedKubeApi()
    try:
        api.start()
        api.call(api.double.put, "inferencepools", inference_pool("qwen3", ports=(pool.port,)))
        for i, host in enumerate(HOSTS):
            api.call(api.double.put, "pods", pod(f"engine-{i}", host))
        kubeconfig = api.double.kubeconfig(pool.tmp)
        epp_port, metrics = free_port(), free_port()
        argv = kvswitch_argv("epp", "--pool-name", "qwen3", "--pool-namespace", "default",
                             "--kubeconfig", str(kubeconfig), "--port", str(epp_port),
                             "--metrics-port", str(metrics), "--log-level", "debug")
        pool.supervisor.start(ChildSpec(
            "epp-kube", argv, ready=lambda: port_open(epp_port)() and epp_pool_ready(
                metrics, len(HOSTS))(), stop_timeout=10.0))
        port, _ = _envoy(pool, "envoy-kube", epp_port, routing="original-dst",
                      target=PoolTarget(()))
        for seed in range(6):
            status, served, request_id = _generate(port, 400 + seed)
            assert status == grpc.StatusCode.OK
            assert served == _epp_pick(pool.supervisor, "epp-kube", request_id)
        for endpoint in pool.endpoints:
            _until_served(port, endpoint, grpc.StatusCode.OK)
        # The EPP serves llm-d's metric names beside its own.
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as reply:
            samples = {s.name: s.value for f in text_string_to_metric_families(
                reply.read().decode()) for s in f.samples if not s.labels or s.name.endswith(
                "ready_endpoints")}
        assert samples["llm_d_epp_ready_endpoints"] == samples[
            "kvswitch_epp_pool_ready_endpoints"] == len(HOSTS)
        # A pod failing its readiness probe leaves the pool; back Ready, it returns.
        first = pool.endpoints[0]
        api.call(api.double.put, "pods", pod("engine-0", HOSTS[0], ready=False))
        _until_served(port, first, grpc.StatusCode.UNAVAILABLE)
        for seed in range(4):
            assert _generate(port, 500 + seed)[1] == pool.endpoints[1]
        api.call(api.double.put, "pods", pod("engine-0", HOSTS[0]))
        _until_served(port, first, grpc.StatusCode.OK)
    finally:
        api.close()


def test_pool_by_dns_as_the_charts_standalone_envoy(pool: Pool) -> None:
    """The Helm chart's standalone Envoy finds replicas by DNS (a headless Service) rather than
    an endpoint list: the pick is honoured, and FailOpen serves with the EPP gone."""
    port = free_port()
    spec = engine_spec("engine-dns", port, profile="tiny", time_scale=100.0, mode="echo",
                       grace_period=1.0)
    pool.supervisor.start(spec)
    endpoint = f"127.0.0.1:{port}"
    pool_file = write_pool_file(pool.tmp / "dns-pool.yaml", [endpoint])
    config = pool.tmp / "dns-epp.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    epp_port, metrics = free_port(), free_port()
    pool.supervisor.start(dataclasses.replace(
        epp_spec(config, pool_file, epp_port, metrics, ("--log-level", "debug"), want_ready=1),
        name="epp-dns"))
    gateway, admin = _envoy(pool, "envoy-dns", epp_port, epp_failure_mode="FailOpen",
                            target=PoolTarget((), service=f"localhost:{port}"))
    status, served, request_id = _generate(gateway, 600)
    assert (status, served) == (grpc.StatusCode.OK, endpoint)
    assert _epp_pick(pool.supervisor, "epp-dns", request_id) == endpoint
    os.kill(pool.supervisor.get("epp-dns").pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not _epp_marked_down(admin):
        assert time.monotonic() < deadline, "Envoy never marked the EPP down"
        time.sleep(0.05)
    assert _generate(gateway, 601)[:2] == (grpc.StatusCode.OK, endpoint)


def _readiness(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
        return int(reply.status)


def test_forbidden_epp_process_is_not_ready_and_says_why(pool: Pool) -> None:
    """`kvswitch epp --pool-name` when RBAC forbids reading pods: it serves, its readiness is
    NOT_SERVING and its log names the API server's refusal; allowed again, it becomes ready."""
    api = ThreadedKubeApi()
    try:
        api.start()
        api.call(api.double.put, "inferencepools", inference_pool("qwen3", ports=(pool.port,)))
        api.call(api.double.put, "pods", pod("engine-0", HOSTS[0]))
        api.call(api.double.forbidden.add, "pods")
        kubeconfig = api.double.kubeconfig(pool.tmp)
        epp_port = free_port()
        argv = kvswitch_argv("epp", "--pool-name", "qwen3", "--kubeconfig", str(kubeconfig),
                             "--port", str(epp_port), "--metrics-port", "0")
        child = pool.supervisor.start(ChildSpec("epp-forbidden", argv,
                                                ready=port_open(epp_port), stop_timeout=10.0))
        assert _readiness(epp_port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert 'forbidden: User "system:serviceaccount:default:epp" cannot list resource ' \
            '"pods"' in child.tail(20_000)
        api.call(api.double.forbidden.clear)
        deadline = time.monotonic() + 10
        while _readiness(epp_port) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, child.tail()
            time.sleep(0.05)
    finally:
        api.close()


@pytest.mark.parametrize("app_protocol", ["http", None])
def test_http_pool_is_reached_over_http1(pool: Pool, app_protocol: str | None) -> None:
    """InferencePoolAppProtocol's other cases: `http`, and appProtocol omitted (HTTP/1.1 by
    default), with an OpenAI-compatible model server that speaks HTTP/1.1 only."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HttpModelServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        name = f"http-{app_protocol}"
        spec: dict[str, Any] = inference_pool(name, ports=(server.server_address[1],))
        if app_protocol is None:
            del spec["spec"]["appProtocol"]
        else:
            spec["spec"]["appProtocol"] = app_protocol
        pool_file = pool.tmp / f"{name}-pool.yaml"
        pool_file.write_text(yaml.safe_dump_all([spec, {
            "apiVersion": "kvswitch.dev/v1alpha1", "kind": "EndpointList",
            "endpoints": [address]}]))
        config = pool.tmp / f"{name}-epp.yaml"
        config.write_text(yaml.safe_dump(HTTP_CONFIG))
        epp_port, metrics = free_port(), free_port()
        pool.supervisor.start(dataclasses.replace(
            epp_spec(config, pool_file, epp_port, metrics, want_ready=1), name=f"epp-{name}"))
        target = read_pool(pool_file)
        assert target.app_protocol == "http"
        gateway, admin = _envoy(pool, f"envoy-{name}", epp_port, target=target)
        request = urllib.request.Request(
            f"http://127.0.0.1:{gateway}/v1/completions", headers={"content-type":
                                                                    "application/json"},
            data=json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1}).encode())
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT) as reply:
            assert reply.status == 200
            assert reply.headers[SERVED_ENDPOINT] == address
        url = f"http://127.0.0.1:{admin}/stats?filter=kvswitch_pool.upstream_cx_http"
        with urllib.request.urlopen(url, timeout=5) as reply:
            stats = dict(line.split(": ") for line in reply.read().decode().splitlines())
        assert int(stats["cluster.kvswitch_pool.upstream_cx_http1_total"]) >= 1
        assert int(stats["cluster.kvswitch_pool.upstream_cx_http2_total"]) == 0
    finally:
        server.shutdown()
        server.server_close()


def test_a_pod_leaving_drains(pool: Pool) -> None:
    """A pod that turns unready gets no new requests, while a stream it is serving finishes."""
    slow = f"127.0.0.4:{pool.port}"
    spec = engine_spec("engine-slow", pool.port, profile="tiny", time_scale=0.1, mode="echo",
                       grace_period=1.0, extra=("--host", "127.0.0.4"))
    pool.supervisor.start(dataclasses.replace(spec, ready=port_open(pool.port, "127.0.0.4")))
    api = ThreadedKubeApi()
    try:
        api.start()
        api.call(api.double.put, "inferencepools", inference_pool("qwen3", ports=(pool.port,)))
        api.call(api.double.put, "pods", pod("slow", "127.0.0.4"))
        api.call(api.double.put, "pods", pod("engine-1", HOSTS[1]))
        kubeconfig = api.double.kubeconfig(pool.tmp)
        epp_port, metrics = free_port(), free_port()
        argv = kvswitch_argv("epp", "--pool-name", "qwen3", "--kubeconfig", str(kubeconfig),
                             "--port", str(epp_port), "--metrics-port", str(metrics))
        pool.supervisor.start(ChildSpec(
            "epp-drain", argv, ready=lambda: port_open(epp_port)() and epp_pool_ready(
                metrics, 2)(), stop_timeout=10.0))
        port, admin = _envoy(pool, "envoy-drain", epp_port, routing="original-dst",
                             target=PoolTarget(()))
        request = pb.GenerateRequest(
            request_id="drain-stream", tokenized=pb.TokenizedInput(input_ids=list(range(1, 65))),
            sampling_params=pb.SamplingParams(max_tokens=300, ignore_eos=True), stream=True)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = rpc.VllmEngineStub(channel).Generate(
                request, metadata=((DESTINATION_SUBSET, slow),), timeout=CALL_TIMEOUT)
            first = next(stream)
            assert dict(stream.initial_metadata())[SERVED_ENDPOINT] == slow
            api.call(api.double.put, "pods", pod("slow", "127.0.0.4", ready=False))
            _until_served(port, slow, grpc.StatusCode.UNAVAILABLE)  # no new requests
            assert _generate(port, 700)[1] == pool.endpoints[1]
            # The stream was still in flight on the pod the pool no longer has...
            url = f"http://127.0.0.1:{admin}/stats?filter=kvswitch_pool.upstream_rq_active"
            with urllib.request.urlopen(url, timeout=5) as reply:
                active = dict(line.split(": ") for line in reply.read().decode().splitlines())
            assert active["cluster.kvswitch_pool.upstream_rq_active"] == "1"
            rest = list(stream)  # ...and goes on to its end.
        assert first.HasField("chunk") and rest[-1].HasField("complete")
        assert rest[-1].complete.finish_reason == "length"
        # (a stream's chunks carry the deltas; their sum is the completion)
        assert sum(r.chunk.completion_tokens for r in (first, *rest) if r.HasField("chunk")) == 300
    finally:
        api.close()
