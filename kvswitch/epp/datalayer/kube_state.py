"""The Kubernetes pool view, sans IO: InferencePool, pods and InferenceObjectives -> endpoints.

`PoolView` is fed whole lists (`replace_*`, after a list or relist) and single watch events
(`apply_*`); it never does IO. Its answers:
- `endpoints()`: for each pod whose labels carry every `spec.selector.matchLabels` pair, that is
  Ready (condition Ready=True), not terminating (no `metadata.deletionTimestamp`) and has a pod
  IP: `podIP:port` for each `spec.targetPorts[].number`, with the pool's `spec.appProtocol`
  (default `http`). No pool (not yet seen, or deleted): no endpoints.
- `priorities()`: `metadata.name -> spec.priority` of the InferenceObjectives whose
  `spec.poolRef.name` is the pool (or that name no pool).

A relist replaces a kind wholesale, so an object deleted while the watch was away goes and
none is counted twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvswitch.epp.datalayer.endpoint import H2C, HTTP, AppProtocol, EndpointSpec

ADDED, MODIFIED, DELETED, BOOKMARK = "ADDED", "MODIFIED", "DELETED", "BOOKMARK"
MAX_TARGET_PORTS = 8
"""The InferencePool CRD's own limit on spec.targetPorts."""

Obj = Mapping[str, Any]


class PoolError(ValueError):
    """The InferencePool object cannot be used (the message names the field)."""


@dataclass(frozen=True, slots=True)
class PoolTarget:
    """What the EPP needs from an InferencePool: whom to select and where to send."""

    selector: tuple[tuple[str, str], ...]
    ports: tuple[int, ...]
    app_protocol: AppProtocol = HTTP


def parse_pool_object(obj: Obj) -> PoolTarget:
    """The selector, target ports and app protocol of an InferencePool object."""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise PoolError("spec: expected an object")
    selector = spec.get("selector") or {}
    labels = selector.get("matchLabels") if isinstance(selector, Mapping) else None
    if not isinstance(labels, Mapping) or not labels:
        raise PoolError("spec.selector.matchLabels: expected at least one label")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise PoolError("spec.selector.matchLabels: expected string keys and values")
    raw_ports = spec.get("targetPorts")
    if not isinstance(raw_ports, list) or not 1 <= len(raw_ports) <= MAX_TARGET_PORTS:
        raise PoolError(f"spec.targetPorts: expected 1 to {MAX_TARGET_PORTS} ports")
    ports: list[int] = []
    for i, raw in enumerate(raw_ports):
        number = raw.get("number") if isinstance(raw, Mapping) else None
        if type(number) is not int or not 0 < number < 65536:
            raise PoolError(f"spec.targetPorts[{i}].number: expected a port, got {number!r}")
        ports.append(number)
    protocol = spec.get("appProtocol", HTTP)
    if protocol not in (HTTP, H2C):
        raise PoolError(f"spec.appProtocol: expected {HTTP} or {H2C}, got {protocol!r}")
    return PoolTarget(tuple(sorted(labels.items())), tuple(dict.fromkeys(ports)), protocol)


def _name(obj: Obj) -> str:
    meta = obj.get("metadata")
    return str(meta.get("name", "")) if isinstance(meta, Mapping) else ""


def pod_serving(pod: Obj) -> str | None:
    """The pod's IP if it may take requests (Ready, not terminating), else None."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return None
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Ready":
            return str(status["podIP"]) if condition.get("status") == "True" else None
    return None


def _matches(pod: Obj, selector: tuple[tuple[str, str], ...]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return all(labels.get(key) == value for key, value in selector)


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class PoolView:
    """The latest InferencePool, pods and objectives of one pool (see the module docstring)."""

    def __init__(self, pool_name: str) -> None:
        self.pool_name = pool_name
        self.target: PoolTarget | None = None
        self.pool_error = ""
        """Why the pool object present cannot be used ("" when it can or is absent)."""
        self._pods: dict[str, Obj] = {}
        self._objectives: dict[str, Obj] = {}

    # -- the pool ------------------------------------------------------------------------------

    def replace_pools(self, items: Iterable[Obj]) -> None:
        pools = [o for o in items if _name(o) == self.pool_name]
        self.set_pool(pools[0] if pools else None)

    def apply_pool(self, kind: str, obj: Obj) -> None:
        if _name(obj) == self.pool_name:
            self.set_pool(None if kind == DELETED else obj)

    def set_pool(self, obj: Obj | None) -> None:
        self.target, self.pool_error = None, ""
        if obj is not None:
            try:
                self.target = parse_pool_object(obj)
            except PoolError as exc:
                self.pool_error = f"InferencePool {self.pool_name}: {exc}"

    # -- pods and objectives -------------------------------------------------------------------

    def replace_pods(self, items: Iterable[Obj]) -> None:
        self._pods = {_name(o): o for o in items}

    def apply_pod(self, kind: str, obj: Obj) -> None:
        _apply(self._pods, kind, obj)

    def replace_objectives(self, items: Iterable[Obj]) -> None:
        self._objectives = {_name(o): o for o in items}

    def apply_objective(self, kind: str, obj: Obj) -> None:
        _apply(self._objectives, kind, obj)

    # -- answers -------------------------------------------------------------------------------

    def endpoints(self) -> tuple[EndpointSpec, ...]:
        target = self.target
        if target is None:
            return ()
        out: list[EndpointSpec] = []
        for name in sorted(self._pods):
            pod = self._pods[name]
            if not _matches(pod, target.selector):
                continue
            ip = pod_serving(pod)
            if ip is not None:
                out.extend(EndpointSpec(_address(ip, p), target.app_protocol) for p in target.ports)
        return tuple(dict.fromkeys(out))

    def priorities(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, obj in sorted(self._objectives.items()):
            spec = obj.get("spec") or {}
            ref = spec.get("poolRef") or {}
            if ref.get("name", self.pool_name) != self.pool_name:
                continue
            priority = spec.get("priority", 0)
            if type(priority) is int:
                out[name] = priority
        return out


def _apply(store: dict[str, Obj], kind: str, obj: Obj) -> None:
    name = _name(obj)
    if kind == DELETED:
        store.pop(name, None)
    elif kind in (ADDED, MODIFIED):
        store[name] = obj
