"""EndpointPickerConfig, phase 1: read YAML documents STRICTLY into frozen specs.

Unknown fields, unknown plugin types and dangling references raise `ConfigError` naming the
field path. Nothing is instantiated and no default is filled here: `kvswitch.epp.config` does
both (phase 2). The accepted fields are listed in `kvswitch.epp.config`'s docstring.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvswitch.epp.config_fields import ConfigError, duration, fields, typed
from kvswitch.epp.datalayer.pool import ObjectiveSpec, parse_objective
from kvswitch.epp.flowcontrol import FlowControlConfig, SaturationConfig
from kvswitch.epp.framework import known_types

__all__ = [
    "CONFIG_API_VERSIONS", "ConfigSpec", "DataLayerSpec", "PluginSpec", "ProfilePluginRef",
    "ProfileSpec", "default_staleness", "parse_config",
]

CONFIG_API_VERSIONS = ("llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1")
_TOP = ("apiVersion", "kind", "metadata", "plugins", "schedulingProfiles", "requestHandler",
        "saturationDetector", "flowControl", "featureGates", "dataLayer")


# ---- specs (phase 1 output) --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PluginSpec:
    """One entry of `plugins`."""

    name: str
    """Unique; defaults to the type (upstream allows omitting it)."""
    type: str
    """A registered plugin type, e.g. `queue-scorer`."""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    """Handed to the plugin's factory as is."""


@dataclass(frozen=True, slots=True)
class ProfilePluginRef:
    """One entry of `schedulingProfiles[].plugins`."""

    plugin_ref: str
    """Name of a plugin in `plugins`."""
    weight: float | None = None
    """Scorers only; None means 1."""


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    """A scheduling profile: its filters, weighted scorers and one picker, by reference."""

    name: str
    """Unique profile name."""
    plugins: tuple[ProfilePluginRef, ...] = ()
    """In order; filters run in this order."""


def default_staleness(refresh_interval: float) -> float:
    """Readiness staleness when not configured: max(2 s, 20 x refreshInterval). Long enough that
    refreshes delayed by CPU contention (or a GC pause) never empty the ready set, short enough
    that a hung engine leaves it within seconds (a dead one leaves at its first failed poll)."""
    return max(2.0, 20 * refresh_interval)


@dataclass(frozen=True, slots=True)
class DataLayerSpec:
    """kvswitch's data-layer settings."""

    refresh_interval: float = 0.05
    """Seconds between two refreshes of one endpoint (upstream refreshes every 50 ms)."""
    staleness_threshold: float = 2.0
    """Seconds without a successful refresh (or pushed load) after which an endpoint is not
    ready (`dataLayer.stalenessThreshold`; default `default_staleness(refresh_interval)`).
    Distinct from saturationDetector.metricsStalenessThreshold, which only affects shedding."""


@dataclass(frozen=True, slots=True)
class ConfigSpec:
    """A parsed EndpointPickerConfig (phase 1), before defaults."""

    plugins: tuple[PluginSpec, ...] = ()
    """Every configured plugin, in file order."""
    profiles: tuple[ProfileSpec, ...] = ()
    """schedulingProfiles."""
    parsers: tuple[str, ...] = ()
    """requestHandler.parsers[].pluginRef, in order of precedence."""
    saturation: SaturationConfig = field(default_factory=SaturationConfig)
    """saturationDetector."""
    flow_control: FlowControlConfig = field(default_factory=FlowControlConfig)
    """flowControl."""
    queueing: bool = False
    """Queue non-sheddable requests under saturation: the `flowControl` feature gate or a
    flowControl section; otherwise only sheddable requests are shed (upstream's legacy path)."""
    feature_gates: tuple[str, ...] = ()
    """featureGates, as given."""
    data_layer: DataLayerSpec = field(default_factory=DataLayerSpec)
    """dataLayer."""
    objectives: tuple[ObjectiveSpec, ...] = ()
    """InferenceObjective documents in the config file."""


# ---- phase 1: parse strictly -------------------------------------------------------------------
def _parse_plugins(raw: object) -> tuple[PluginSpec, ...]:
    out: list[PluginSpec] = []
    names: set[str] = set()
    types = known_types()
    for i, item in enumerate(typed(raw, "plugins", list)):
        path = f"plugins[{i}]"
        p = fields(item, path, ("type",), ("name", "parameters"))
        type_name = typed(p["type"], f"{path}.type", str)
        if type_name not in types:
            raise ConfigError(f"{path}.type: unknown plugin type {type_name!r}")
        name = typed(p.get("name", type_name), f"{path}.name", str)
        if name in names:
            raise ConfigError(f"{path}.name: duplicate plugin name {name!r}")
        names.add(name)
        params = p.get("parameters") or {}
        out.append(PluginSpec(name, type_name, dict(typed(params, f"{path}.parameters", dict))))
    return tuple(out)


def _parse_profiles(raw: object, names: set[str]) -> tuple[ProfileSpec, ...]:
    out: list[ProfileSpec] = []
    seen: set[str] = set()
    for i, item in enumerate(typed(raw, "schedulingProfiles", list)):
        path = f"schedulingProfiles[{i}]"
        p = fields(item, path, ("name",), ("plugins",))
        name = typed(p["name"], f"{path}.name", str)
        if name in seen:
            raise ConfigError(f"{path}.name: duplicate profile name {name!r}")
        seen.add(name)
        refs = []
        for j, ref_raw in enumerate(typed(p.get("plugins") or [], f"{path}.plugins", list)):
            rpath = f"{path}.plugins[{j}]"
            r = fields(ref_raw, rpath, ("pluginRef",), ("weight",))
            ref = typed(r["pluginRef"], f"{rpath}.pluginRef", str)
            if ref not in names:
                raise ConfigError(f"{rpath}.pluginRef: no plugin named {ref!r}")
            weight = r.get("weight")
            if weight is not None:
                weight = float(typed(weight, f"{rpath}.weight", (int, float)))
                if weight < 0:
                    raise ConfigError(f"{rpath}.weight: must not be negative")
            refs.append(ProfilePluginRef(ref, weight))
        out.append(ProfileSpec(name, tuple(refs)))
    return tuple(out)


def _parse_parsers(raw: object, names: set[str]) -> tuple[str, ...]:
    handler = fields(raw, "requestHandler", (), ("parsers",))
    out = []
    for i, item in enumerate(typed(handler.get("parsers") or [], "requestHandler.parsers", list)):
        path = f"requestHandler.parsers[{i}]"
        ref = typed(fields(item, path, ("pluginRef",))["pluginRef"], f"{path}.pluginRef", str)
        if ref not in names:
            raise ConfigError(f"{path}.pluginRef: no plugin named {ref!r}")
        out.append(ref)
    return tuple(out)


def _parse_saturation(raw: object) -> SaturationConfig:
    d = SaturationConfig()
    s = fields(raw, "saturationDetector", (),
               ("queueDepthThreshold", "kvCacheUtilThreshold", "metricsStalenessThreshold"))
    kv = float(typed(s.get("kvCacheUtilThreshold", d.kv_cache_util_threshold),
                     "saturationDetector.kvCacheUtilThreshold", (int, float)))
    if not 0.0 < kv <= 1.0:
        raise ConfigError("saturationDetector.kvCacheUtilThreshold: must be in (0, 1]")
    return SaturationConfig(
        queue_depth_threshold=typed(s.get("queueDepthThreshold", d.queue_depth_threshold),
                                    "saturationDetector.queueDepthThreshold", int),
        kv_cache_util_threshold=kv,
        metrics_staleness=duration(s.get("metricsStalenessThreshold", d.metrics_staleness),
                                   "saturationDetector.metricsStalenessThreshold"))


def _parse_flow_control(raw: object) -> FlowControlConfig:
    d = FlowControlConfig()
    f = fields(raw, "flowControl", (),
               ("maxQueuedPerFlow", "maxWait", "fairness", "fairnessWeights"))
    fairness = f.get("fairness", d.fairness)
    if fairness not in ("round-robin", "weighted"):
        raise ConfigError(f"flowControl.fairness: expected round-robin or weighted, "
                          f"got {fairness!r}")
    weights = typed(f.get("fairnessWeights", {}), "flowControl.fairnessWeights", dict)
    for key, w in weights.items():
        if typed(w, f"flowControl.fairnessWeights.{key}", int) < 1:
            raise ConfigError(f"flowControl.fairnessWeights.{key}: must be >= 1")
    return FlowControlConfig(
        max_queued_per_flow=typed(f.get("maxQueuedPerFlow", d.max_queued_per_flow),
                                  "flowControl.maxQueuedPerFlow", int),
        max_wait=duration(f.get("maxWait", d.max_wait), "flowControl.maxWait"),
        fairness=fairness, fairness_weights={str(k): v for k, v in weights.items()})


def parse_config(docs: Sequence[Mapping[str, Any]]) -> ConfigSpec:
    """An EndpointPickerConfig (+ InferenceObjective docs) -> ConfigSpec; no documents -> {}."""
    configs = [(i, d) for i, d in enumerate(docs) if d.get("kind") != "InferenceObjective"]
    objectives = tuple(parse_objective(d, f"config[{i}]") for i, d in enumerate(docs)
                       if d.get("kind") == "InferenceObjective")
    if len(configs) > 1:
        raise ConfigError(f"config: expected one EndpointPickerConfig, got {len(configs)}")
    if not configs:
        return ConfigSpec(objectives=objectives)
    doc = fields(configs[0][1], "", ("apiVersion", "kind"), _TOP)
    if doc["kind"] != "EndpointPickerConfig":
        raise ConfigError(f"kind: expected EndpointPickerConfig, got {doc['kind']!r}")
    if doc["apiVersion"] not in CONFIG_API_VERSIONS:
        raise ConfigError(f"apiVersion: expected one of {', '.join(CONFIG_API_VERSIONS)}, "
                          f"got {doc['apiVersion']!r}")
    plugins = _parse_plugins(doc.get("plugins") or [])
    names = {p.name for p in plugins}
    gates = tuple(typed(g, f"featureGates[{i}]", str)
                  for i, g in enumerate(typed(doc.get("featureGates") or [], "featureGates", list)))
    data = fields(doc.get("dataLayer") or {}, "dataLayer", (),
                  ("refreshInterval", "stalenessThreshold"))
    interval = duration(data.get("refreshInterval", 0.05), "dataLayer.refreshInterval")
    if interval <= 0:
        raise ConfigError("dataLayer.refreshInterval: must be positive")
    staleness = default_staleness(interval)
    if "stalenessThreshold" in data:
        staleness = duration(data["stalenessThreshold"], "dataLayer.stalenessThreshold")
        if staleness <= interval:
            raise ConfigError("dataLayer.stalenessThreshold: must exceed refreshInterval")
    return ConfigSpec(
        plugins=plugins,
        profiles=_parse_profiles(doc.get("schedulingProfiles") or [], names),
        parsers=_parse_parsers(doc.get("requestHandler") or {}, names),
        saturation=_parse_saturation(doc.get("saturationDetector") or {}),
        flow_control=_parse_flow_control(doc.get("flowControl") or {}),
        queueing="flowControl" in gates or "flowControl" in doc,
        feature_gates=gates, data_layer=DataLayerSpec(interval, staleness),
        objectives=objectives)
