"""The pool file: InferencePool + EndpointList (+ InferenceObjective), parsed strictly.

    apiVersion: inference.networking.k8s.io/v1
    kind: InferencePool
    metadata:
      name: qwen3
      annotations: {kvswitch.dev/engine-api: sglang}   # h2c pools: vllm (default) or sglang
    spec:
      selector: {matchLabels: {app: qwen3}}
      targetPorts: [{number: 8000}]
      appProtocol: kubernetes.io/h2c    # or http (default); a targetPort may carry its own
      endpointPickerRef: {name: qwen3-epp, port: {number: 9002}}
    ---
    apiVersion: kvswitch.dev/v1alpha1      # outside Kubernetes: who matches the selector
    kind: EndpointList
    metadata: {name: qwen3}
    endpoints: ["127.0.0.1:8001", "127.0.0.1:8002", "10.0.0.7"]   # bare ip: every targetPort
    ---
    apiVersion: inference.networking.x-k8s.io/v1alpha2
    kind: InferenceObjective
    metadata: {name: batch}
    spec: {priority: -1, poolRef: {name: qwen3}}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvswitch.epp.config_fields import ConfigError, fields, typed
from kvswitch.epp.datalayer.endpoint import H2C, HTTP, AppProtocol, EndpointSpec

POOL_API_VERSIONS = ("inference.networking.k8s.io/v1", "inference.networking.x-k8s.io/v1alpha2")
OBJECTIVE_API_VERSIONS = ("inference.networking.x-k8s.io/v1alpha2", "llm-d.ai/v1alpha2",
                          "inference.networking.k8s.io/v1alpha2", "llm-d.ai/v1alpha1")
ENDPOINT_LIST_API_VERSION = "kvswitch.dev/v1alpha1"
ENGINE_API_ANNOTATION = "kvswitch.dev/engine-api"
ENGINE_APIS = ("vllm", "sglang")
_DOC_KEYS = ("apiVersion", "kind", "metadata")


@dataclass(frozen=True, slots=True)
class ObjectiveSpec:
    """An InferenceObjective: requests naming it get its priority."""

    name: str
    """metadata.name, what `x-llm-d-inference-objective` names."""
    priority: int = 0
    """Higher is served first; negative is sheddable under saturation."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The InferencePool and its endpoints."""

    name: str
    """metadata.name of the InferencePool."""
    endpoints: tuple[EndpointSpec, ...]
    """Every endpoint with its app protocol, from the EndpointList and targetPorts."""
    objectives: tuple[ObjectiveSpec, ...] = ()
    """InferenceObjective documents found in the pool file."""
    endpoint_picker: str = ""
    """spec.endpointPickerRef.name."""
    api: str = "vllm"
    """The engine API every endpoint speaks (annotation `kvswitch.dev/engine-api`)."""


def _name(doc: Mapping[str, Any], path: str) -> str:
    meta = fields(doc.get("metadata", {}), f"{path}.metadata", (),
                  ("name", "namespace", "labels", "annotations"))
    return typed(meta.get("name", ""), f"{path}.metadata.name", str)


def _engine_api(doc: Mapping[str, Any], path: str) -> str:
    """The InferencePool's `kvswitch.dev/engine-api` annotation (default vllm)."""
    annotations = typed(doc.get("metadata", {}).get("annotations") or {},
                        f"{path}.metadata.annotations", dict)
    api = annotations.get(ENGINE_API_ANNOTATION, "vllm")
    if api not in ENGINE_APIS:
        raise ConfigError(f"{path}.metadata.annotations[{ENGINE_API_ANNOTATION}]: expected one "
                          f"of {', '.join(ENGINE_APIS)}, got {api!r}")
    return str(api)


def _api(doc: Mapping[str, Any], path: str, allowed: Sequence[str]) -> None:
    if doc.get("apiVersion") not in allowed:
        raise ConfigError(f"{path}.apiVersion: expected one of {', '.join(allowed)}, "
                          f"got {doc.get('apiVersion')!r}")


def parse_objective(doc: Mapping[str, Any], path: str) -> ObjectiveSpec:
    fields(doc, path, ("apiVersion", "kind", "metadata", "spec"))
    _api(doc, path, OBJECTIVE_API_VERSIONS)
    name = _name(doc, path)
    if not name:
        raise ConfigError(f"{path}.metadata.name: required")
    spec = fields(doc["spec"], f"{path}.spec", (), ("priority", "poolRef"))
    return ObjectiveSpec(name, typed(spec.get("priority", 0), f"{path}.spec.priority", int))


def _protocol(raw: Any, path: str) -> AppProtocol:
    if raw not in (HTTP, H2C):
        raise ConfigError(f"{path}: expected {HTTP} or {H2C}, got {raw!r}")
    return raw  # type: ignore[no-any-return]


def _target_ports(spec: Mapping[str, Any], path: str) -> list[tuple[int, AppProtocol]]:
    ports = typed(spec["targetPorts"], f"{path}.targetPorts", list)
    if not ports:
        raise ConfigError(f"{path}.targetPorts: at least one port is required")
    # The v1 CRD's spec.appProtocol; a port's own appProtocol (kvswitch's form) overrides it.
    pool_proto = _protocol(spec.get("appProtocol", HTTP), f"{path}.appProtocol")
    out: list[tuple[int, AppProtocol]] = []
    for i, raw in enumerate(ports):
        p = f"{path}.targetPorts[{i}]"
        port = fields(raw, p, ("number",), ("appProtocol",))
        number = typed(port["number"], f"{p}.number", int)
        if not 0 < number < 65536:
            raise ConfigError(f"{p}.number: {number} is not a port")
        out.append((number, _protocol(port.get("appProtocol", pool_proto), f"{p}.appProtocol")))
    return out


def _endpoints(doc: Mapping[str, Any], path: str,
               ports: Sequence[tuple[int, AppProtocol]]) -> list[EndpointSpec]:
    fields(doc, path, ("apiVersion", "kind", "endpoints"), ("metadata",))
    _api(doc, path, (ENDPOINT_LIST_API_VERSION,))
    by_port = dict(ports)
    default_proto = ports[0][1]
    out = []
    for i, raw in enumerate(typed(doc["endpoints"], f"{path}.endpoints", list)):
        p = f"{path}.endpoints[{i}]"
        address = typed(raw, p, str).strip()
        host, sep, port_text = address.rpartition(":")
        if sep and port_text.isdigit() and host and not host.endswith(":"):
            out.append(EndpointSpec(address, by_port.get(int(port_text), default_proto)))
        elif address and ":" not in address:
            out.extend(EndpointSpec(f"{address}:{n}", proto) for n, proto in ports)
        else:
            raise ConfigError(f"{p}: expected 'ip:port' or 'ip', got {raw!r}")
    return out


def parse_pool(docs: Sequence[Mapping[str, Any]]) -> PoolSpec:
    """The pool from its documents (see the module docstring); ConfigError naming the field."""
    pools = [(i, d) for i, d in enumerate(docs) if d.get("kind") == "InferencePool"]
    lists = [(i, d) for i, d in enumerate(docs) if d.get("kind") == "EndpointList"]
    objectives = []
    for i, doc in enumerate(docs):
        kind = doc.get("kind")
        if kind == "InferenceObjective":
            objectives.append(parse_objective(doc, f"pool[{i}]"))
        elif kind not in ("InferencePool", "EndpointList"):
            raise ConfigError(f"pool[{i}].kind: expected InferencePool, EndpointList or "
                              f"InferenceObjective, got {kind!r}")
    if len(pools) != 1:
        raise ConfigError(f"pool: expected one InferencePool document, got {len(pools)}")
    index, pool = pools[0]
    path = f"pool[{index}]"
    fields(pool, path, ("apiVersion", "kind", "spec"), ("metadata", "status"))
    _api(pool, path, POOL_API_VERSIONS)
    spec = fields(pool["spec"], f"{path}.spec", ("targetPorts",),
                  ("selector", "endpointPickerRef", "appProtocol"))
    ports = _target_ports(spec, f"{path}.spec")
    epp = fields(spec.get("endpointPickerRef", {}), f"{path}.spec.endpointPickerRef", (),
                 ("name", "kind", "group", "port", "failureMode"))
    if not lists:
        raise ConfigError("pool: no EndpointList document (outside Kubernetes the pool file "
                          "lists its endpoints)")
    api = _engine_api(pool, path)
    endpoints: list[EndpointSpec] = []
    for i, doc in lists:
        endpoints.extend(EndpointSpec(e.address, e.app_protocol, api)
                         for e in _endpoints(doc, f"pool[{i}]", ports))
    return PoolSpec(_name(pool, path), tuple(dict.fromkeys(endpoints)), tuple(objectives),
                    typed(epp.get("name", ""), f"{path}.spec.endpointPickerRef.name", str), api)
