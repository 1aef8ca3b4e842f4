"""Load an EndpointPickerConfig and an InferencePool and build the endpoint picker.

Two phases, as upstream: `parse_config` (`kvswitch.epp.config_spec`) / `parse_pool` read YAML
documents STRICTLY into frozen specs (unknown fields, unknown plugin types, dangling refs ->
`ConfigError` naming the field path); `build_endpoint_picker` fills defaults (in `apply_defaults`,
the one place) and instantiates plugins. Accepted documents:

- `EndpointPickerConfig` (apiVersion llm-d.ai/v1alpha1, or upstream's older
  inference.networking.x-k8s.io/v1alpha1): plugins, schedulingProfiles, requestHandler,
  saturationDetector, flowControl, featureGates, plus kvswitch's `dataLayer` (refreshInterval,
  stalenessThreshold: readiness, default max(2 s, 20 x refreshInterval); the saturation
  detector's metricsStalenessThreshold keeps upstream's meaning and only affects shedding).
- `InferencePool` (inference.networking.k8s.io/v1): selector, targetPorts, endpointPickerRef.
- `EndpointList` (kvswitch.dev/v1alpha1): the pool's endpoints outside Kubernetes, `ip:port` or
  `ip` (one endpoint per targetPort). Lives in the pool file next to the InferencePool.
- `InferenceObjective` (inference.networking.x-k8s.io/v1alpha2): metadata.name, spec.priority
  (negative = sheddable); in either file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from kvswitch.epp.config_spec import (
    ConfigSpec,
    DataLayerSpec,
    PluginSpec,
    ProfilePluginRef,
    ProfileSpec,
    default_staleness,
    parse_config,
)
from kvswitch.epp.contracts import EndpointPicker, Parser
from kvswitch.epp.datalayer import (
    Datalayer,
    Discovery,
    Refresher,
    StaticDiscovery,
    default_collector,
)
from kvswitch.epp.datalayer.discovery import SuppliesObjectives
from kvswitch.epp.datalayer.pool import PoolSpec, parse_pool
from kvswitch.epp.flowcontrol import FlowGate
from kvswitch.epp.framework import (
    ConfigError,
    Filter,
    Picker,
    PluginHandle,
    ProfileHandler,
    Scheduler,
    SchedulerProfile,
    Scorer,
    load_factory,
)
from kvswitch.epp.kvindex import KvBlockIndex, KvEventSubscriptions
from kvswitch.epp.metrics import EppMetrics, default_metrics
from kvswitch.epp.router import EppRouter
from kvswitch.tls import UpstreamTls

__all__ = [
    "DEFAULT_PROFILE_WEIGHTS",
    "ConfigError",
    "ConfigSpec",
    "DataLayerSpec",
    "PluginSpec",
    "PoolSpec",
    "ProfilePluginRef",
    "ProfileSpec",
    "apply_defaults",
    "build_endpoint_picker",
    "build_router",
    "default_staleness",
    "load_documents",
    "parse_config",
    "parse_pool",
    "static_pool",
]

# ---- defaults (the one place) ------------------------------------------------------------------
# Upstream's default profile (the GAIE chart's default config): prefix 3, queue 2, kv-util 2.
DEFAULT_PROFILE_WEIGHTS: tuple[tuple[str, float], ...] = (
    ("prefix-cache-scorer", 3.0), ("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0))
DEFAULT_PICKER = "max-score-picker"
DEFAULT_HANDLER = "single-profile-handler"
DEFAULT_PARSERS = ("vllmgrpc-parser", "sglanggrpc-parser", "openai-parser")
DEFAULT_PROFILE = "default"


def _ensure(plugins: list[PluginSpec], type_name: str) -> str:
    """The name of a plugin of `type_name`, adding one (named after the type) if none exists."""
    for p in plugins:
        if p.type == type_name:
            return p.name
    plugins.append(PluginSpec(type_name, type_name, {}))
    return type_name


def apply_defaults(spec: ConfigSpec, plugin_roles: Mapping[str, str] | None = None) -> ConfigSpec:
    """Fill what the config leaves out:
    - no schedulingProfiles: one "default" profile; with no scheduling plugins either, it is
      upstream's default (prefix-cache 3, queue 2, kv-cache-utilization 2, max-score-picker),
      else it references every filter/scorer/picker plugin (weight 1);
    - a profile without a picker gets a max-score-picker;
    - no profile handler: single-profile-handler;
    - no requestHandler.parsers: vllmgrpc-parser, sglanggrpc-parser and openai-parser.
    `plugin_roles` (name -> "filter"|"scorer"|"picker"|"handler"|"parser"|"other") comes from
    instantiating the configured plugins; without it only the role-free defaults apply.
    """
    roles = dict(plugin_roles or {})
    plugins = list(spec.plugins)
    profiles = list(spec.profiles)
    if not profiles:
        schedulable = [p.name for p in plugins if roles.get(p.name) in ("filter", "scorer",
                                                                          "picker")]
        if schedulable:
            refs = tuple(ProfilePluginRef(n, 1.0 if roles[n] == "scorer" else None)
                         for n in schedulable)
        else:
            refs = tuple(ProfilePluginRef(_ensure(plugins, t), w)
                         for t, w in DEFAULT_PROFILE_WEIGHTS)
        profiles.append(ProfileSpec(DEFAULT_PROFILE, refs))
    fixed = []
    for profile in profiles:
        if plugin_roles is not None and not any(roles.get(r.plugin_ref) == "picker"
                                                for r in profile.plugins):
            ref = ProfilePluginRef(_ensure(plugins, DEFAULT_PICKER), None)
            profile = ProfileSpec(profile.name, profile.plugins + (ref,))
        fixed.append(profile)
    if plugin_roles is not None and not any(r == "handler" for r in roles.values()):
        _ensure(plugins, DEFAULT_HANDLER)
    parsers = spec.parsers or tuple(_ensure(plugins, t) for t in DEFAULT_PARSERS)
    return ConfigSpec(plugins=tuple(plugins), profiles=tuple(fixed), parsers=parsers,
                      saturation=spec.saturation, flow_control=spec.flow_control,
                      queueing=spec.queueing, feature_gates=spec.feature_gates,
                      data_layer=spec.data_layer, objectives=spec.objectives)


# ---- loading -----------------------------------------------------------------------------------
def load_documents(source: Path | str | Mapping[str, Any] | Sequence[Mapping[str, Any]],
                   what: str) -> list[Mapping[str, Any]]:
    """YAML documents from a path, YAML text (a str with a newline), one mapping or a list."""
    if isinstance(source, Mapping):
        return [source]
    if isinstance(source, (str, Path)):
        if isinstance(source, str) and "\n" in source:
            text = source
        else:
            try:
                text = Path(source).read_text()
            except OSError as exc:
                raise ConfigError(f"{what}: cannot read {source}: {exc}") from exc
        try:
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
        except (yaml.YAMLError, ValueError, OverflowError) as exc:  # pyyaml: on bad escapes
            raise ConfigError(f"{what}: invalid YAML: {exc}") from exc
    else:
        docs = list(source)
    for i, doc in enumerate(docs):
        if not isinstance(doc, Mapping):
            raise ConfigError(f"{what}: document {i}: expected a mapping")
    return docs


def static_pool(addresses: Sequence[str], app_protocol: str = "kubernetes.io/h2c",
                name: str = "kvswitch", api: str = "vllm") -> list[Mapping[str, Any]]:
    """Pool documents for a fixed list of `ip:port` endpoints (for `kvswitch up` and tests);
    `api` "sglang" annotates the InferencePool as an SGLang pool."""
    port = int(addresses[0].rpartition(":")[2]) if addresses else 8000
    metadata: dict[str, Any] = {"name": name}
    if api != "vllm":
        metadata["annotations"] = {"kvswitch.dev/engine-api": api}
    return [
        {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
         "metadata": metadata,
         "spec": {"selector": {"matchLabels": {"app": name}},
                  "targetPorts": [{"number": port, "appProtocol": app_protocol}],
                  "endpointPickerRef": {"name": f"{name}-epp"}}},
        {"apiVersion": "kvswitch.dev/v1alpha1", "kind": "EndpointList",
         "metadata": {"name": name}, "endpoints": list(addresses)},
    ]


# ---- instantiation -----------------------------------------------------------------------------
def _role(plugin: object) -> str:
    if isinstance(plugin, Picker) and hasattr(plugin, "pick"):
        return "picker"
    if isinstance(plugin, ProfileHandler):
        return "handler"
    if isinstance(plugin, Scorer):
        return "scorer"
    if isinstance(plugin, Filter):
        return "filter"
    if isinstance(plugin, Parser):
        return "parser"
    return "other"


def _instantiate(specs: Sequence[PluginSpec], handle: PluginHandle,
                 built: dict[str, object]) -> dict[str, object]:
    """Build the plugins not built yet, in order (a factory may look up earlier ones)."""
    for i, spec in enumerate(specs):
        if spec.name in built:
            continue
        try:
            plugin = load_factory(spec.type)(spec.name, spec.parameters, handle)
        except ConfigError as exc:
            raise ConfigError(f"plugins[{i}] ({spec.name}): {exc}") from exc
        built[spec.name] = plugin
        handle.add_plugin(spec.name, plugin)
    return built


def _profiles(spec: ConfigSpec, built: Mapping[str, object]) -> dict[str, SchedulerProfile]:
    profiles: dict[str, SchedulerProfile] = {}
    for i, profile in enumerate(spec.profiles):
        filters: list[Filter] = []
        scorers: list[tuple[Scorer, float]] = []
        pickers: list[Picker] = []
        for j, ref in enumerate(profile.plugins):
            path = f"schedulingProfiles[{i}].plugins[{j}]"
            plugin = built[ref.plugin_ref]
            role = _role(plugin)
            if role == "scorer":
                scorers.append(
                    (plugin, 1.0 if ref.weight is None else ref.weight))  # type: ignore[arg-type]
            elif ref.weight is not None:
                raise ConfigError(f"{path}.weight: {ref.plugin_ref!r} is a {role}, not a scorer")
            elif role == "filter":
                filters.append(plugin)  # type: ignore[arg-type]
            elif role == "picker":
                pickers.append(plugin)  # type: ignore[arg-type]
            else:
                raise ConfigError(f"{path}.pluginRef: {ref.plugin_ref!r} is a {role}, "
                                  "not a filter, scorer or picker")
        if len(pickers) != 1:
            raise ConfigError(f"schedulingProfiles[{i}]: expected one picker, got {len(pickers)}")
        profiles[profile.name] = SchedulerProfile(profile.name, filters, scorers, pickers[0])
    return profiles


def build_router(spec: ConfigSpec, pool: PoolSpec, metrics: EppMetrics | None = None,
                 handle: PluginHandle | None = None, discovery: Discovery | None = None,
                 engine_tls: UpstreamTls | None = None) -> tuple[EppRouter, list[Parser]]:
    """Instantiate a parsed config against a parsed pool (or `discovery`, which then supplies
    the endpoints, and objective priorities if it has `on_objectives`). With `engine_tls`, the
    load collectors and KV-event subscriptions call the engines over TLS."""
    dl = spec.data_layer
    datalayer = Datalayer(staleness=dl.staleness_threshold)
    handle = handle or PluginHandle(datalayer, engine_tls)
    built = _instantiate(spec.plugins, handle, {})
    spec = apply_defaults(spec, {n: _role(p) for n, p in built.items()})
    built = _instantiate(spec.plugins, handle, built)
    handlers = [p for p in built.values() if _role(p) == "handler"]
    if len(handlers) != 1:
        raise ConfigError(f"plugins: expected one profile handler, got {len(handlers)}")
    handler: ProfileHandler = handlers[0]  # type: ignore[assignment]
    if getattr(handler, "max_profiles", None) == 1 and len(spec.profiles) != 1:
        raise ConfigError(f"schedulingProfiles: {handler.name} needs exactly one profile, "
                          f"got {len(spec.profiles)}")
    parsers: list[Parser] = []
    for i, name in enumerate(spec.parsers):
        if not isinstance(built[name], Parser):
            raise ConfigError(f"requestHandler.parsers[{i}].pluginRef: {name!r} is not a parser")
        parsers.append(built[name])  # type: ignore[arg-type]
    plugins = [*built.values(), *handle.shared_objects()]
    scheduler = Scheduler(handler, _profiles(spec, built),
                          [p for p in plugins if _role(p) != "parser"])
    refresher = Refresher(datalayer, discovery or StaticDiscovery(pool.endpoints),
                          interval=dl.refresh_interval,
                          collector_factory=partial(default_collector, tls=handle.engine_tls))
    gate = FlowGate(datalayer.ready, spec.saturation, spec.flow_control,
                    tick=dl.refresh_interval, queueing=spec.queueing)
    objectives = {o.name: o.priority for o in (*pool.objectives, *spec.objectives)}
    metrics = metrics if metrics is not None else default_metrics()
    for plugin in plugins:
        if isinstance(index := getattr(plugin, "index", None), KvBlockIndex):
            metrics.indexed_blocks.watch(index)
            metrics.speculative_blocks.watch(index)
            metrics.pending_prefill.watch(index)
        if isinstance(streams := getattr(plugin, "subscriptions", None), KvEventSubscriptions):
            metrics.load_records.watch(streams.subscribers)
    router = EppRouter(scheduler, datalayer, gate, refresher, objectives, metrics)
    if isinstance(discovery, SuppliesObjectives):
        # Watched InferenceObjectives win over the config file's, as a pool file's would.
        discovery.on_objectives = lambda found: setattr(router, "objectives",
                                                        {**objectives, **found})
    return router, parsers


Source = Path | str | Mapping[str, Any] | Sequence[Mapping[str, Any]]


def build_endpoint_picker(config: Source | None, pool: Source | None,
                          metrics: EppMetrics | None = None,
                          discovery: Discovery | None = None,
                          engine_tls: UpstreamTls | None = None) -> EndpointPicker:
    """The EPP's parsers and router from an EndpointPickerConfig (None: all defaults) and a pool
    file, or a `discovery` (Kubernetes) in place of the pool file; `engine_tls`: call the
    engines over TLS.

    Paths are read as YAML (several documents allowed); a str containing a newline is YAML text.
    """
    spec = parse_config(load_documents(config, "config") if config is not None else [])
    if pool is None and discovery is None:
        raise ConfigError("pool: a pool file or a discovery is required")
    pool_spec = parse_pool(load_documents(pool, "pool")) if pool is not None else PoolSpec("", ())
    router, parsers = build_router(spec, pool_spec, metrics, discovery=discovery,
                                   engine_tls=engine_tls)
    return EndpointPicker(parsers=parsers, router=router)
