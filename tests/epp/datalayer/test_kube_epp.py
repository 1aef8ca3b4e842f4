"""The EPP on Kubernetes discovery: readiness over grpc.health.v1 follows discovery's health,
watched InferenceObjectives become the router's priorities, and the sans-IO pool view."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvswitch.epp.config import build_endpoint_picker
from kvswitch.epp.datalayer import H2C, HTTP, EndpointSpec
from kvswitch.epp.datalayer.kube_discovery import KubernetesDiscovery, api_client
from kvswitch.epp.datalayer.kube_state import PoolError, PoolView, parse_pool_object
from kvswitch.epp.router import EppRouter
from kvswitch.epp.server import EppServer
from tests.support.kube_api import KubeApiDouble, inference_objective, inference_pool, pod
from tests.support.waiting import until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
async def api() -> AsyncIterator[KubeApiDouble]:
    double = KubeApiDouble()
    await double.start()
    yield double
    await double.stop()


async def _readiness(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="readiness"))
        return int(reply.status)


async def test_readiness_follows_rbac_and_objectives_reach_the_router(
        api: KubeApiDouble, tmp_path: Path) -> None:
    api.put("inferencepools", inference_pool("qwen3"))
    api.put("pods", pod("a", "10.0.0.1"))
    api.put("inferenceobjectives", inference_objective("batch", -2, "qwen3"))
    api.forbidden.add("pods")
    kubeconfig = str(api.kubeconfig(tmp_path))
    discovery = KubernetesDiscovery("qwen3", "default", lambda: api_client(kubeconfig),
                                    backoff_initial=0.01, backoff_max=0.05)
    config = ("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n---\n"
              "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceObjective\n"
              "metadata: {name: chat}\nspec: {priority: 3}\n")
    picker = build_endpoint_picker(config, None, discovery=discovery)
    router = picker.router
    assert isinstance(router, EppRouter)
    server = EppServer(picker, port=0)
    await server.start()
    try:
        # RBAC forbids listing pods: the EPP serves but says it is not ready.
        assert await _readiness(server.port) == NOT_SERVING
        assert "forbidden" in discovery.problem
        api.forbidden.clear()
        await until(lambda: server.health_status("readiness") == SERVING)
        assert await _readiness(server.port) == SERVING
        await until(lambda: [e.address for e in router.datalayer.all()] == ["10.0.0.1:8000"])
        # The config file's objective stays; the watched one joins it and follows changes.
        await until(lambda: router.objectives == {"chat": 3, "batch": -2})
        api.put("inferenceobjectives", inference_objective("batch", 4, "qwen3"))
        await until(lambda: router.objectives == {"chat": 3, "batch": 4})
        # A pod leaving drains: it is no longer a candidate.
        api.delete("pods", "a")
        await until(lambda: router.datalayer.all() == [])
    finally:
        await server.stop(0)


def test_pool_view_addresses_and_rejections() -> None:
    view = PoolView("p")
    view.set_pool(inference_pool("p", ports=(8000, 8001), app_protocol=HTTP))
    view.replace_pods([pod("v6", "fd00::1"), pod("v4", "10.0.0.1")])
    assert view.endpoints() == (
        EndpointSpec("10.0.0.1:8000", HTTP), EndpointSpec("10.0.0.1:8001", HTTP),
        EndpointSpec("[fd00::1]:8000", HTTP), EndpointSpec("[fd00::1]:8001", HTTP))
    default = inference_pool("p")
    del default["spec"]["appProtocol"]
    assert parse_pool_object(default).app_protocol == HTTP
    assert parse_pool_object(inference_pool("p")).app_protocol == H2C
    for field, value, message in (
            ("targetPorts", [], "spec.targetPorts"),
            ("targetPorts", [{"number": 70000}], "targetPorts[0].number"),
            ("selector", {"matchLabels": {}}, "matchLabels"),
            ("appProtocol", "grpc", "spec.appProtocol")):
        bad = inference_pool("p")
        bad["spec"][field] = value
        with pytest.raises(PoolError, match=message.replace("[", r"\[")):
            parse_pool_object(bad)
    # A pool that does not parse selects nothing, and says why.
    bad = inference_pool("p")
    bad["spec"]["targetPorts"] = [{"number": p} for p in range(1, 10)]
    view.set_pool(bad)
    assert view.endpoints() == () and "targetPorts" in view.pool_error


def test_a_v1_inference_pool_works_for_file_discovery_too(tmp_path: Path) -> None:
    """The same InferencePool object (spec.appProtocol, as the v1 CRD has it) in a pool file."""
    import yaml

    from kvswitch.envoy import read_pool
    from kvswitch.epp.config import ConfigError, parse_pool

    pool = inference_pool("qwen3", ports=(8000, 8001))
    endpoints = {"apiVersion": "kvswitch.dev/v1alpha1", "kind": "EndpointList",
                 "endpoints": ["10.0.0.1"]}
    spec = parse_pool([pool, endpoints])
    assert spec.endpoints == (EndpointSpec("10.0.0.1:8000", H2C),
                              EndpointSpec("10.0.0.1:8001", H2C))
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump_all([pool, endpoints]))
    assert read_pool(path).app_protocol == H2C
    pool["spec"]["appProtocol"] = "grpc"
    with pytest.raises(ConfigError, match=r"spec\.appProtocol: expected http"):
        parse_pool([pool, endpoints])
