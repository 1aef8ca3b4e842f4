"""The Envoy bootstrap: every shape passes `envoy --mode validate`, and the pool cluster routes
by the destination header as documented (real Envoy, HTTP/1.1 backends on loopback)."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvswitch import cli
from kvswitch.envoy import (
    EnvoyProcess,
    GatewayOptions,
    PoolTarget,
    build_bootstrap,
    read_pool,
    render,
    validate_config,
)
from kvswitch.protocol.headers import DESTINATION_ENDPOINT
from tests.support.processes import free_port

POOL_YAML = """\
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: tiny}
spec:
  selector: {matchLabels: {app: tiny}}
  targetPorts: [{number: 8001, appProtocol: kubernetes.io/h2c}]
---
apiVersion: kvswitch.dev/v1alpha1
kind: EndpointList
metadata: {name: tiny}
endpoints: ["127.0.0.1:8001", {address: "127.0.0.1:8002"}, {ip: 127.0.0.1, port: 8003}, 127.0.0.2]
"""


@pytest.fixture
def pool_file(tmp_path: Path) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(POOL_YAML)
    return path


def test_read_pool_accepts_every_endpoint_form(pool_file: Path) -> None:
    pool = read_pool(pool_file)
    assert pool.endpoints == ("127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003",
                              "127.0.0.2:8001")
    assert pool.app_protocol == "kubernetes.io/h2c"


@pytest.mark.parametrize("extra", [
    [],
    ["--routing", "original-dst"],
    ["--round-robin"],
    ["--frontend", "127.0.0.1:7001", "--frontend", "127.0.0.1:7002"],
    ["--access-log", "--port", "18000", "--admin-port", "19901"],
    ["--epp-header", "x-user-session", "--epp-header", "x-tenant-*"],
    ["--epp-all-headers"],
])
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_envoy_config_command_output_validates(
    pool_file: Path, tmp_path: Path, extra: list[str], suffix: str
) -> None:
    out = tmp_path / f"envoy{suffix}"
    assert cli.main(["envoy-config", "--pool", str(pool_file), *extra, "-o", str(out)]) == 0
    result = validate_config(out)
    assert result.returncode == 0, result.stdout + result.stderr


def _filters(bootstrap: dict[str, Any]) -> list[str]:
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return [f["name"] for f in hcm["http_filters"]]


def test_shapes() -> None:
    pool = PoolTarget(("127.0.0.1:1",))
    assert _filters(build_bootstrap(GatewayOptions(pool=pool))) == [
        "envoy.filters.http.header_mutation", "envoy.filters.http.set_metadata",
        "envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    assert _filters(build_bootstrap(GatewayOptions(pool=pool, round_robin=True))) == [
        "envoy.filters.http.router"]
    with pytest.raises(ValueError):
        build_bootstrap(GatewayOptions(pool=pool, epps=()))


def _ext_proc_config(bootstrap: dict[str, Any]) -> dict[str, Any]:
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    return dict(ext_proc["typed_config"])


def test_a_stream_an_epp_fails_is_retried_on_another_epp() -> None:
    pool = PoolTarget(("127.0.0.1:1",))
    epps = ("127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4")
    policy = _ext_proc_config(build_bootstrap(GatewayOptions(pool=pool, epps=epps)))[
        "grpc_service"]["retry_policy"]
    assert policy["num_retries"] == 2
    assert [p["name"] for p in policy["retry_host_predicate"]] == [
        "envoy.retry_host_predicates.previous_hosts"]
    # Least request prefers the dead EPP (no streams left): one reselection is not enough.
    assert policy["host_selection_retry_max_attempts"] >= 10
    single = _ext_proc_config(build_bootstrap(GatewayOptions(pool=pool, epps=epps[:1])))
    assert "retry_policy" not in single["grpc_service"]


def test_only_the_headers_the_epp_reads_are_sent_to_it() -> None:
    pool = PoolTarget(("127.0.0.1:1",))
    config = _ext_proc_config(build_bootstrap(GatewayOptions(
        pool=pool, epp_headers=(":path", "X-Request-Id", "x-llm-d-*", "x-request-id"))))
    # Pseudo-headers are matched like any other; names are lowercased and deduplicated.
    assert config["forward_rules"]["allowed_headers"]["patterns"] == [
        {"exact": ":path"}, {"exact": "x-request-id"}, {"prefix": "x-llm-d-"}]
    assert "forward_rules" not in _ext_proc_config(
        build_bootstrap(GatewayOptions(pool=pool, epp_headers=None)))


def test_envoy_config_sends_the_epp_its_configs_session_header(
        pool_file: Path, tmp_path: Path) -> None:
    epp = tmp_path / "epp.yaml"
    epp.write_text("kind: EndpointPickerConfig\nplugins:\n"
                   "- {name: s, type: session-affinity-scorer,"
                   " parameters: {headerName: x-user-session}}\n")
    out = tmp_path / "envoy.json"
    assert cli.main(["envoy-config", "--pool", str(pool_file), "--epp-config", str(epp),
                     "-o", str(out)]) == 0
    patterns = _ext_proc_config(json.loads(out.read_text()))["forward_rules"]["allowed_headers"]
    assert {"exact": "x-user-session"} in patterns["patterns"]
    result = validate_config(out)
    assert result.returncode == 0, result.stdout + result.stderr


class _PortEcho(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = str(self.server.server_address[1]).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def backends() -> Iterator[tuple[int, int, int]]:
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PortEcho) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    dead = free_port()
    yield servers[0].server_address[1], servers[1].server_address[1], dead
    for server in servers:
        server.shutdown()
        server.server_close()


def _header_routed_envoy(tmp_path: Path, routing: str, ports: tuple[int, ...]) -> tuple[
        EnvoyProcess, int]:
    """The pool route with the EPP's filters removed, so the test's header plays the EPP."""
    port, admin = free_port(), free_port()
    options = GatewayOptions(
        pool=PoolTarget(tuple(f"127.0.0.1:{p}" for p in ports), app_protocol="http"),
        port=port, admin_port=admin, routing=routing,  # type: ignore[arg-type]
    )
    bootstrap = build_bootstrap(options)
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm["typed_config"]["http_filters"] = hcm["typed_config"]["http_filters"][-1:]
    path = tmp_path / f"{routing}.yaml"
    path.write_text(render(bootstrap))
    return EnvoyProcess(path, admin), port


def _get(port: int, destination: str) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/",
                                     headers={DESTINATION_ENDPOINT: destination})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_override_host_honours_pick_and_fallbacks(
    tmp_path: Path, backends: tuple[int, int, int]
) -> None:
    a, b, dead = backends
    envoy, port = _header_routed_envoy(tmp_path, "override-host", (a, b, dead))
    with envoy:
        assert _get(port, f"127.0.0.1:{a}") == (200, str(a))
        assert _get(port, f"127.0.0.1:{b},127.0.0.1:{a}") == (200, str(b))
        # The pick refuses connections: the retry goes to the first fallback.
        assert _get(port, f"127.0.0.1:{dead},127.0.0.1:{a}") == (200, str(a))


def test_original_dst_takes_one_address_only(
    tmp_path: Path, backends: tuple[int, int, int]
) -> None:
    a, b, _ = backends
    envoy, port = _header_routed_envoy(tmp_path, "original-dst", (a, b))
    with envoy:
        assert _get(port, f"127.0.0.1:{b}") == (200, str(b))
        status, _ = _get(port, f"127.0.0.1:{a},127.0.0.1:{b}")
        assert status == 503
