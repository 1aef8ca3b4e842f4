"""The Helm chart, rendered by Helm's own Go SDK (helm-python-sdk) in every mode, each object
validated against the Kubernetes schemas (kubernetes-validate) or its CRD's own schema, and the
containers' commands checked against kvswitch's CLIs (Envoy validates the bootstrap the chart's
init container writes)."""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from kvswitch.cli import main as kvswitch_main
from kvswitch.engine import cli as engine_cli
from kvswitch.envoy.process import validate_config
from kvswitch.epp import cli as epp_cli
from kvswitch.epp.config import DEFAULT_PROFILE_WEIGHTS, apply_defaults, parse_config
from kvswitch.epp.datalayer import kube_discovery
from kvswitch.frontend import cli as frontend_cli
from kvswitch.launcher import DEFAULT_EPP_CONFIG
from kvswitch.tls import TlsFiles, UpstreamTls, tls_from_args, upstream_tls_from_args
from tests.support.chart import CHART, TLS_DIR, by_kind, render, validate
from tests.support.chart import secret as _secret
from tests.support.processes import REPO

MODES: dict[str, dict[str, Any]] = {
    "standalone": {},
    "standalone-frontend-simulated": {
        "router": {"frontend": {"enabled": True, "servedModelNames": ["qwen3"]},
                   "monitoring": {"prometheus": {"enabled": True}},
                   "inferenceObjectives": [{"name": "batch", "priority": -1},
                                           {"name": "chat", "priority": 5}],
                   "epp": {"flags": {"log-level": "debug"}}},
        "modelServers": {"enabled": True}},
    "standalone-fail-close-http": {
        "router": {"proxy": {"failOpen": False},
                   "modelServers": {"protocol": "http", "targetPorts": [{"number": 8000},
                                                                        {"number": 8001}]}}},
    "gateway": {"mode": "gateway", "httpRoute": {"create": True}},
    "gateway-gke": {"mode": "gateway", "provider": {"name": "gke"},
                    "httpRoute": {"create": True}},
    "gateway-istio-vllm": {"mode": "gateway", "provider": {"name": "istio"},
                           "httpRoute": {"create": True, "inferenceGatewayNamespace": "gw"},
                           "modelServers": {"enabled": True, "kind": "vllm"}},
    "gateway-existing-pool": {"mode": "gateway", "router": {"inferencePool": {"create": False}}},
    "standalone-3-epps": {"router": {"epp": {"replicas": 3}, "frontend": {"enabled": True}}},
    "gateway-2-epps": {"mode": "gateway", "router": {"epp": {"replicas": 2}}},
    "standalone-tls-frontend-simulated": {
        "tls": {"secretName": "qwen3-tls", "handshakeTimeout": 5},
        "router": {"frontend": {"enabled": True}}, "modelServers": {"enabled": True}},
    "standalone-tls-3-epps": {"tls": {"secretName": "qwen3-tls"},
                              "router": {"epp": {"replicas": 3}},
                              "modelServers": {"enabled": True}},
    "gateway-tls-2-epps-istio": {
        "mode": "gateway", "tls": {"secretName": "qwen3-tls"}, "router": {"epp": {"replicas": 2}},
        "provider": {"name": "istio", "istio": {"destinationRule": {"trafficPolicy": {
            "connectionPool": {"http": {"maxRequestsPerConnection": 256000}}}}}},
        "modelServers": {"enabled": True}},
    "gateway-tls-gke": {"mode": "gateway", "tls": {"secretName": "qwen3-tls"},
                        "provider": {"name": "gke"}},
    "gateway-plaintext-istio": {"mode": "gateway", "provider": {"name": "istio"},
                                "router": {"epp": {"flags": {"secure-serving": False}}}},
    "gateway-istio-verifying": {"mode": "gateway", "tls": {"secretName": "qwen3-tls"},
                                "provider": {"name": "istio", "istio": {"destinationRule": {
                                    "trafficPolicy": {"tls": {
                                        "mode": "SIMPLE", "credentialName": "qwen3-epp-ca",
                                        "sni": "qwen3-epp.llm.svc"}}}}}},
}


def test_lint() -> None:
    assert helm_python.lint(str(CHART))["errors"] == []
    for values in MODES.values():
        assert helm_python.lint(str(CHART), values)["errors"] == []


@pytest.mark.parametrize("mode", MODES)
def test_every_object_is_valid(mode: str) -> None:
    validate(render(MODES[mode]))


def _merge(into: dict[str, Any], values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _documented_installs() -> list[list[str]]:
    """The `helm install` commands of docs/kubernetes.md and docs/multi-epp.md, continuation
    lines joined."""
    text = "\n".join((REPO / "docs" / doc).read_text().replace("\\\n", " ")
                      for doc in ("kubernetes.md", "multi-epp.md"))
    return [shlex.split(line.split("#")[0]) for line in text.splitlines()
            if line.startswith("helm install ")]


def test_the_documented_helm_installs_render_valid_objects() -> None:
    installs = _documented_installs()
    assert len(installs) >= 5
    for argv in installs:
        assert argv[3] == "deploy/helm/kvswitch", argv
        values: dict[str, Any] = {}
        for i, arg in enumerate(argv):
            if arg == "--set":
                _merge(values, helm_python.parse_set_string(argv[i + 1]))
        namespace = argv[argv.index("--namespace") + 1]
        validate(render(values, name=argv[2], namespace=namespace), namespace)


@pytest.mark.parametrize("mode", MODES)
def test_containers_run_kvswitch_commands_that_parse(mode: str, tmp_path: Path) -> None:
    docs = render(MODES[mode])
    for deployment in [*by_kind(docs, "Deployment"), *by_kind(docs, "StatefulSet")]:
        pod = deployment["spec"]["template"]["spec"]
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            args = container.get("args", [])
            if container.get("command") or not args:
                continue
            if args[0] == "epp":
                parser = argparse.ArgumentParser()
                epp_cli.add_arguments(parser)
                parsed = parser.parse_args(args[1:])
                assert parsed.pool_name == "qwen3" and parsed.pool_namespace == "llm"
            elif args[0] == "envoy-config":
                # The bootstrap the init container writes, and Envoy accepts it.
                out = tmp_path / "envoy.yaml"
                config = tmp_path / "epp.yaml"
                (config_map,) = by_kind(docs, "ConfigMap")
                config.write_text(config_map["data"]["default-plugins.yaml"])
                argv = [a.replace(TLS_DIR, str(_secret(tmp_path))) for a in args
                        if not a.startswith(("--output=", "--epp-config="))]
                with contextlib.redirect_stdout(io.StringIO()):
                    assert kvswitch_main([*argv, f"--epp-config={config}",
                                          f"--output={out}"]) == 0
                checked = validate_config(out)
                assert checked.returncode == 0, checked.stdout + checked.stderr
            else:
                assert args[0] in ("engine", "frontend"), args


def _parse(command: str, args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module = {"epp": epp_cli, "engine": engine_cli, "frontend": frontend_cli}[command]
    module.add_arguments(parser)
    return parser.parse_args(args)


def test_tls_values_mount_the_secret_and_pass_every_hop_its_flags() -> None:
    docs = render(MODES["standalone-tls-frontend-simulated"])
    deployments = {d["metadata"]["name"]: d["spec"]["template"]["spec"]
                   for d in by_kind(docs, "Deployment")}
    epp, engines = deployments["qwen3-epp"], deployments["qwen3-engine"]
    for pod in (epp, engines):
        assert {"name": "tls", "secret": {"secretName": "qwen3-tls"}} in pod["volumes"]
    containers = {c["name"]: c for c in [*epp["containers"], *engines["containers"]]}
    for name in ("epp", "envoy", "frontend", "engine"):
        assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in \
            containers[name]["volumeMounts"], name
    client = UpstreamTls(Path(f"{TLS_DIR}/ca.crt"), Path(f"{TLS_DIR}/tls.crt"),
                         Path(f"{TLS_DIR}/tls.key"), "qwen3-pool.llm.svc")
    server = TlsFiles(Path(f"{TLS_DIR}/tls.crt"), Path(f"{TLS_DIR}/tls.key"), None, 5.0)
    # The EPP calls the engines, the frontend the listener, over mTLS; the engines serve it.
    assert upstream_tls_from_args(_parse("epp", containers["epp"]["args"][1:]), "engine") == client
    frontend = _parse("frontend", containers["frontend"]["args"][1:])
    assert upstream_tls_from_args(frontend, "target") == client
    engine = _parse("engine", containers["engine"]["args"][1:])
    assert tls_from_args(engine) == TlsFiles(server.cert, server.key,
                                             Path(f"{TLS_DIR}/ca.crt"), 5.0)
    # Envoy: the listener serves TLS, and calls the engines over mTLS.
    init = _parse_envoy_config(epp["initContainers"][0]["args"][1:])
    assert tls_from_args(init) == server
    assert upstream_tls_from_args(init, "engine") == client
    # The kubelet's gRPC probe has no TLS: the TLS engine is probed on its HTTP /health.
    assert containers["engine"]["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8001}
    # Without a secret, nothing of it.
    plain = render(MODES["standalone-frontend-simulated"])
    assert TLS_DIR not in yaml.safe_dump(plain)


def _parse_envoy_config(args: list[str]) -> argparse.Namespace:
    from kvswitch.envoy.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(args)


def test_standalone_is_one_deployment_and_service_wired_like_kvswitch_up() -> None:
    docs = render(MODES["standalone-frontend-simulated"])
    epp = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "qwen3-epp")
    pod = epp["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"epp", "envoy", "frontend"}
    init = pod["initContainers"][0]["args"]
    assert "--frontend=127.0.0.1:8200" in init and "--epp=127.0.0.1:9002" in init
    assert "--epp-failure-mode=FailOpen" in init
    assert "--target=127.0.0.1:8081" in containers["frontend"]["args"]
    # One image for all, non-root.
    images = {c["image"] for c in [*pod["containers"], *pod["initContainers"]]}
    assert images == {"ghcr.io/kvswitch/kvswitch:0.1.0"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    # The EPP's probes are on its metrics port (/ready: its readiness service's status), so they
    # work whatever the ext_proc port serves.
    assert containers["epp"]["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 9090}
    assert containers["epp"]["livenessProbe"]["httpGet"] == {"path": "/health", "port": 9090}
    assert containers["epp"]["startupProbe"]["httpGet"] == {"path": "/health", "port": 9090}
    assert all("resources" in c for c in pod["containers"])
    service = next(d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "qwen3-epp")
    assert service["spec"]["selector"] == epp["spec"]["template"]["metadata"]["labels"]
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc-ext-proc",
                                                              "http-metrics"}
    # The simulated engines are what the pool selects, on its h2c target port.
    pool = by_kind(docs, "InferencePool")[0]
    engines = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] != "qwen3-epp")
    labels = engines["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["appProtocol"] == "kubernetes.io/h2c"
    engine = engines["spec"]["template"]["spec"]["containers"][0]
    assert engine["args"][:3] == ["engine", "--host=0.0.0.0", "--port=8000"]
    assert engine["readinessProbe"]["grpc"] == {"port": 8000}
    assert {o["metadata"]["name"]: o["spec"]["priority"]
            for o in by_kind(docs, "InferenceObjective")} == {"batch": -1, "chat": 5}
    assert by_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]["port"] == "http-metrics"


def _default_config(values: Mapping[str, Any]) -> Any:
    (config_map,) = by_kind(render(values), "ConfigMap")
    return yaml.safe_load(config_map["data"]["default-plugins.yaml"])


def test_default_profile_is_kvswitch_ups_for_grpc_pools_and_upstreams_for_http() -> None:
    # A gRPC pool streams KV events: the profile `kvswitch up` runs, chosen on the panel.
    assert _default_config({}) == DEFAULT_EPP_CONFIG
    assert _default_config(MODES["gateway-istio-vllm"]) == DEFAULT_EPP_CONFIG
    # An HTTP pool does not: the EPP's built-in default (upstream's weights) fills the profile.
    config = _default_config(MODES["standalone-fail-close-http"])
    assert "plugins" not in config and "schedulingProfiles" not in config
    (profile,) = apply_defaults(parse_config([config])).profiles
    assert tuple((r.plugin_ref, r.weight) for r in profile.plugins) == DEFAULT_PROFILE_WEIGHTS
    # A config of the user's under the same name replaces it.
    mine = {"pluginsCustomConfig": {"default-plugins.yaml": "kind: EndpointPickerConfig\n"}}
    assert _default_config({"router": {"epp": mine}}) == {"kind": "EndpointPickerConfig"}


def test_rbac_is_exactly_what_discovery_reads() -> None:
    docs = render({})
    (role,) = by_kind(docs, "Role")
    rules = {(g, r, tuple(rule["verbs"])) for rule in role["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    read = ("list", "watch")  # all discovery does: no get
    assert rules == {("", "pods", read),
                     (kube_discovery.POOL_GROUP, kube_discovery.POOL_PLURAL, read),
                     (kube_discovery.OBJECTIVE_GROUP, kube_discovery.OBJECTIVE_PLURAL, read)}
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["subjects"][0]["name"] == by_kind(docs, "ServiceAccount")[0]["metadata"]["name"]


def test_gateway_modes() -> None:
    docs = render(MODES["gateway"])
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "InferencePool", "HTTPRoute"}
    (epp,) = by_kind(docs, "Deployment")
    assert [c["name"] for c in epp["spec"]["template"]["spec"]["containers"]] == ["epp"]
    (route,) = by_kind(docs, "HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "qwen3"}
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
    (pool,) = by_kind(docs, "InferencePool")
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "qwen3-epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
    gke = render(MODES["gateway-gke"])
    policies = by_kind(gke, "HealthCheckPolicy")
    assert {p["spec"]["targetRef"]["kind"] for p in policies} == {"InferencePool", "Service"}
    assert "timeouts" not in by_kind(gke, "HTTPRoute")[0]["spec"]["rules"][0]
    istio = render(MODES["gateway-istio-vllm"])
    (rule,) = by_kind(istio, "DestinationRule")
    assert rule["spec"]["host"] == "qwen3-epp.llm.svc.cluster.local"
    vllm = next(d for d in by_kind(istio, "Deployment") if d["metadata"]["name"] == "qwen3-engine")
    container = vllm["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["vllm", "serve"] and "--grpc" in container["args"]
    assert not by_kind(render(MODES["gateway-existing-pool"]), "InferencePool")


@pytest.mark.parametrize(("values", "message"), [
    ({"mode": "sidecar"}, "mode: expected standalone or gateway"),
    ({"router": {"modelServers": {"protocol": "grpcs"}}}, "router.modelServers.protocol"),
    ({"router": {"modelServers": {"matchLabels": None}}}, "matchLabels"),
    ({"mode": "gateway", "router": {"frontend": {"enabled": True}}}, "standalone mode only"),
    ({"provider": {"name": "aws"}}, "provider.name"),
    ({"router": {"epp": {"replicas": 0}}}, "router.epp.replicas: expected at least 1"),
    ({"router": {"epp": {"flags": {"secure-serving": False}}}},
     "router.epp.flags.secure-serving: gateway mode only"),
])
def test_bad_values_fail_naming_the_value(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmError, match=message):
        render(values)


def test_default_image_is_what_the_dockerfile_builds() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    built = next(line.split("docker build -t ")[1].split()[0]
                 for line in dockerfile.splitlines() if "docker build -t " in line)
    images = {c["image"] for d in by_kind(render({"modelServers": {"enabled": True}}),
                                          "Deployment")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {built}
    # Non-root, and `kvswitch` is the entrypoint the chart's args follow.
    assert "\nUSER 10001:10001\n" in dockerfile
    assert 'ENTRYPOINT ["kvswitch"]' in dockerfile


def _flag(args: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]


def test_several_epps_are_a_statefulset_each_signing_with_the_name_envoy_lists(
        tmp_path: Path) -> None:
    docs = render(MODES["standalone-3-epps"])
    assert all(d["metadata"]["name"] != "qwen3-epp" for d in by_kind(docs, "Deployment"))
    (epps,) = by_kind(docs, "StatefulSet")
    assert epps["metadata"]["name"] == "qwen3-epp" and epps["spec"]["replicas"] == 3
    # The headless Service that gives each pod its stable name, ready or not (Envoy checks).
    peers = next(d for d in by_kind(docs, "Service")
                 if d["metadata"]["name"] == epps["spec"]["serviceName"])
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"]
    pod = epps["spec"]["template"]
    assert peers["spec"]["selector"] == pod["metadata"]["labels"]
    init = pod["spec"]["initContainers"][0]["args"]
    listed = _flag(init, "epp")
    assert listed == [f"qwen3-epp-{i}.qwen3-epp-peers.llm.svc:9002" for i in range(3)]
    epp = next(c for c in pod["spec"]["containers"] if c["name"] == "epp")
    (signature,) = _flag(epp["args"], "replica-name")
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in epp["env"]}
    assert env["POD_NAME"] == "metadata.name"
    # Pod i of the StatefulSet is named qwen3-epp-i: its signature is the i-th address listed.
    assert [signature.replace("$(POD_NAME)", f"qwen3-epp-{i}") for i in range(3)] == listed
    # The bootstrap every pod's Envoy runs: all three EPPs by DNS, one access log per EPP
    # filtered on its signature, and Envoy accepts it.
    out, config = tmp_path / "envoy.yaml", tmp_path / "epp.yaml"
    config.write_text("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n")
    argv = [a for a in init if not a.startswith(("--output=", "--epp-config="))]
    with contextlib.redirect_stdout(io.StringIO()):
        assert kvswitch_main([*argv, f"--epp-config={config}", f"--output={out}"]) == 0
    bootstrap = yaml.safe_load(out.read_text())
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    ext_proc = clusters["kvswitch_epp"]
    assert ext_proc["type"] == "STRICT_DNS" and ext_proc["lb_policy"] == "LEAST_REQUEST"
    hosts = [e["endpoint"]["address"]["socket_address"]["address"]
             for e in ext_proc["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert hosts == [a.rsplit(":", 1)[0] for a in listed]
    text = out.read_text()
    assert all(text.count(f"exact: {address}") == 1 for address in listed)
    checked = validate_config(out)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_several_epps_behind_another_gateway_stay_a_deployment() -> None:
    (epps,) = by_kind(render(MODES["gateway-2-epps"]), "Deployment")
    assert epps["spec"]["replicas"] == 2
    (epp,) = epps["spec"]["template"]["spec"]["containers"]
    assert not _flag(epp["args"], "replica-name")  # that gateway's Envoy sends no access log


def test_several_epps_with_tls_serve_and_are_called_over_mtls(tmp_path: Path) -> None:
    docs = render(MODES["standalone-tls-3-epps"])
    (epps,) = by_kind(docs, "StatefulSet")
    pod = epps["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    # Every EPP serves mTLS on its ext_proc port with the Secret...
    epp = _parse("epp", containers["epp"]["args"][1:])
    assert tls_from_args(epp) == TlsFiles(Path(f"{TLS_DIR}/tls.crt"), Path(f"{TLS_DIR}/tls.key"),
                                          Path(f"{TLS_DIR}/ca.crt"), 10.0)
    for name in ("epp", "envoy"):
        assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in \
            containers[name]["volumeMounts"], name
    # ...and is probed on its plaintext metrics port, which the kubelet can reach.
    assert containers["epp"]["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 9090}
    assert "grpc" not in yaml.safe_dump(containers["epp"]["livenessProbe"])
    # Every pod's Envoy calls every EPP (ext_proc with its health checks, and each EPP's own
    # access-log cluster) over mTLS, verifying the Secret's server name.
    init = pod["initContainers"][0]["args"]
    client = UpstreamTls(Path(f"{TLS_DIR}/ca.crt"), Path(f"{TLS_DIR}/tls.crt"),
                         Path(f"{TLS_DIR}/tls.key"), "qwen3-pool.llm.svc")
    assert upstream_tls_from_args(_parse_envoy_config(init[1:]), "epp") == client
    secret = _secret(tmp_path)
    out, config = tmp_path / "envoy.yaml", tmp_path / "epp.yaml"
    config.write_text("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n")
    argv = [a.replace(TLS_DIR, str(secret)) for a in init
            if not a.startswith(("--output=", "--epp-config="))]
    with contextlib.redirect_stdout(io.StringIO()):
        assert kvswitch_main([*argv, f"--epp-config={config}", f"--output={out}"]) == 0
    clusters = {c["name"]: c
                for c in yaml.safe_load(out.read_text())["static_resources"]["clusters"]}
    epp_clusters = [c for name, c in clusters.items() if name.startswith("kvswitch_epp")]
    assert len(epp_clusters) == 4  # ext_proc, and one access-log cluster per EPP
    for cluster in epp_clusters:
        tls = cluster["transport_socket"]["typed_config"]
        assert tls["sni"] == "qwen3-pool.llm.svc"
        assert tls["common_tls_context"]["tls_certificates"][0]["certificate_chain"] == {
            "filename": str((secret / "tls.crt").resolve())}
    checked = validate_config(out)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # One EPP is Envoy's loopback neighbour in its pod: that hop stays h2c; so does every hop to
    # the EPPs with tls.epps off.
    for values in ({"tls": {"secretName": "qwen3-tls"}},
                   {"tls": {"secretName": "qwen3-tls", "epps": False},
                    "router": {"epp": {"replicas": 3}}}):
        docs = render(values)
        (deployment,) = [*by_kind(docs, "StatefulSet"),
                         *[d for d in by_kind(docs, "Deployment")
                           if d["metadata"]["name"] == "qwen3-epp"]]
        pod = deployment["spec"]["template"]["spec"]
        assert not _flag(pod["initContainers"][0]["args"], "epp-tls-ca"), values
        epp_args = next(c for c in pod["containers"] if c["name"] == "epp")["args"]
        assert not _flag(epp_args, "tls-cert"), values
