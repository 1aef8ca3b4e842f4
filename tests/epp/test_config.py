"""EndpointPickerConfig / pool loading: strict parsing, named errors, defaults, upstream files."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvswitch.epp.config import (
    ConfigError,
    apply_defaults,
    build_endpoint_picker,
    load_documents,
    parse_config,
    static_pool,
)
from kvswitch.epp.datalayer import H2C, HTTP, EndpointSpec
from kvswitch.epp.datalayer.pool import parse_pool
from kvswitch.epp.metrics import EppMetrics
from kvswitch.epp.plugins.kv_cache_utilization_scorer import KvCacheUtilizationScorer
from kvswitch.epp.plugins.max_score_picker import MaxScorePicker
from kvswitch.epp.plugins.prefix_cache_scorer import PrefixCacheScorer
from kvswitch.epp.plugins.queue_scorer import QueueScorer
from kvswitch.epp.router import EppRouter

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
POOL = static_pool(["127.0.0.1:9001", "127.0.0.1:9002"])

# An upstream config written as upstream documents it (older apiVersion, names omitted,
# `kv-cache-scorer` alias, `hashBlockSize`, the picker listed in the profile without a weight).
UPSTREAM = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-scorer
- type: prefix-cache-scorer
  parameters:
    hashBlockSize: 64
    maxPrefixBlocksToMatch: 256
    lruCapacityPerServer: 31250
- type: max-score-picker
  parameters:
    maxNumOfEndpoints: 1
- type: single-profile-handler
- name: vllmgrpcParser
  type: vllmgrpc-parser
- name: openaiParser
  type: openai-parser
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-scorer
    weight: 1
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
requestHandler:
  parsers:
  - pluginRef: vllmgrpcParser
  - pluginRef: openaiParser
"""


def build(config: object, pool: object = POOL) -> tuple[EppRouter, list[str]]:
    picker = build_endpoint_picker(config, pool, metrics=EppMetrics())  # type: ignore[arg-type]
    assert isinstance(picker.router, EppRouter)
    return picker.router, [p.name for p in picker.parsers]


def test_upstream_config_loads_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(UPSTREAM)
    router, parsers = build(path)
    assert parsers == ["vllmgrpcParser", "openaiParser"]
    profile = router.scheduler.profiles["default"]
    kinds = [(type(s).__name__, w) for s, w in profile.scorers]
    assert kinds == [("QueueScorer", 1.0), ("KvCacheUtilizationScorer", 1.0),
                     ("PrefixCacheScorer", 3.0)]
    prefix = profile.scorers[2][0]
    assert isinstance(prefix, PrefixCacheScorer) and prefix.index.block_size == 64
    assert isinstance(profile.picker, MaxScorePicker)


def test_examples_load() -> None:
    router, parsers = build(EXAMPLES / "epp-config.yaml", EXAMPLES / "pool.yaml")
    assert parsers == ["vllmgrpc-parser", "sglanggrpc-parser", "openai-parser"]
    assert router.objectives == {"interactive": 10, "batch": -1}
    assert router.gate.queues.queueing
    assert router.refresher is not None and router.refresher.interval == pytest.approx(0.05)


def test_no_config_means_upstream_defaults() -> None:
    router, parsers = build(None)
    assert parsers == ["vllmgrpc-parser", "sglanggrpc-parser", "openai-parser"]
    profile = router.scheduler.profiles["default"]
    assert [(type(s), w) for s, w in profile.scorers] == [
        (PrefixCacheScorer, 3.0), (QueueScorer, 2.0), (KvCacheUtilizationScorer, 2.0)]
    assert isinstance(profile.picker, MaxScorePicker)
    assert not router.gate.queues.queueing  # flowControl gate off: shed only


def test_profile_without_picker_gets_max_score_and_plugins_without_profile_get_one() -> None:
    router, _ = build({"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig",
                       "plugins": [{"type": "queue-scorer"}]})
    profile = router.scheduler.profiles["default"]
    assert [type(s) for s, _ in profile.scorers] == [QueueScorer]
    assert isinstance(profile.picker, MaxScorePicker)


def test_defaults_are_filled_in_one_place() -> None:
    spec = apply_defaults(parse_config([]), {})
    assert [p.type for p in spec.plugins] == [
        "prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer",
        "max-score-picker", "single-profile-handler", "vllmgrpc-parser", "sglanggrpc-parser",
        "openai-parser"]


BASE = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig"}


@pytest.mark.parametrize(("extra", "message"), [
    ({"plugin": []}, "^plugin: unknown field"),
    ({"plugins": [{"type": "nope"}]}, r"^plugins\[0\].type: unknown plugin type 'nope'"),
    ({"plugins": [{"type": "queue-scorer", "weight": 1}]}, r"^plugins\[0\].weight: unknown"),
    ({"plugins": [{"type": "queue-scorer"}, {"type": "queue-scorer"}]},
     r"^plugins\[1\].name: duplicate plugin name 'queue-scorer'"),
    ({"plugins": [{"type": "queue-scorer"}],
      "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "queue-scorer"},
                                                       {"pluginRef": "x"}]}]},
     r"^schedulingProfiles\[0\].plugins\[1\].pluginRef: no plugin named 'x'"),
    ({"plugins": [{"type": "max-score-picker"}],
      "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "max-score-picker",
                                                        "weight": 2}]}]},
     r"^schedulingProfiles\[0\].plugins\[0\].weight: 'max-score-picker' is a picker"),
    ({"requestHandler": {"parsers": [{"pluginRef": "p"}]}},
     r"^requestHandler.parsers\[0\].pluginRef: no plugin named 'p'"),
    ({"plugins": [{"type": "queue-scorer"}],
      "requestHandler": {"parsers": [{"pluginRef": "queue-scorer"}]}},
     r"^requestHandler.parsers\[0\].pluginRef: 'queue-scorer' is not a parser"),
    ({"plugins": [{"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": "2"}}]},
     r"^plugins\[0\] \(max-score-picker\): parameters.maxNumOfEndpoints: expected int"),
    ({"saturationDetector": {"kvCacheUtilThreshold": 2}},
     r"^saturationDetector.kvCacheUtilThreshold: must be in"),
    ({"flowControl": {"fairness": "lottery"}}, "^flowControl.fairness: expected"),
    ({"featureGates": "flowControl"}, "^featureGates: expected list"),
    ({"kind": "Other"}, "^kind: expected EndpointPickerConfig"),
    ({"dataLayer": {"refreshInterval": "1s", "stalenessThreshold": "500ms"}},
     "^dataLayer.stalenessThreshold: must exceed refreshInterval"),
    ({"apiVersion": "v1"}, "^apiVersion: expected one of"),
])
def test_config_errors_name_the_field(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build({**BASE, **extra})


def test_pool_file_with_endpoint_list_and_ports() -> None:
    docs = load_documents("""\
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: p}
spec:
  selector: {matchLabels: {app: p}}
  targetPorts: [{number: 8000, appProtocol: kubernetes.io/h2c}, {number: 9000}]
  endpointPickerRef: {name: p-epp}
---
apiVersion: kvswitch.dev/v1alpha1
kind: EndpointList
endpoints: ["10.0.0.1:9000", "10.0.0.2"]
""", "pool")
    pool = parse_pool(docs)
    assert pool.name == "p" and pool.endpoint_picker == "p-epp"
    assert pool.endpoints == (EndpointSpec("10.0.0.1:9000", HTTP),
                              EndpointSpec("10.0.0.2:8000", H2C),
                              EndpointSpec("10.0.0.2:9000", HTTP))


@pytest.mark.parametrize(("docs", "message"), [
    ([], "expected one InferencePool"),
    ([POOL[0]], "no EndpointList"),
    ([{**POOL[0], "spec": {"targetPorts": [{"number": 1, "appProtocol": "grpc"}]}}, POOL[1]],
     r"^pool\[0\].spec.targetPorts\[0\].appProtocol: expected http or kubernetes.io/h2c"),
    ([POOL[0], {**POOL[1], "endpoints": ["a:b:c:"]}], r"^pool\[1\].endpoints\[0\]: expected"),
    ([*POOL, {"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
              "kind": "InferenceObjective", "metadata": {"name": "o"},
              "spec": {"priority": "high"}}], r"^pool\[2\].spec.priority: expected int"),
])
def test_pool_errors_name_the_field(docs: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_pool(docs)


def test_readiness_staleness_is_its_own_setting() -> None:
    base = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig"}
    assert parse_config([base]).data_layer.staleness_threshold == 2.0  # max(2 s, 20 x 50 ms)
    slow = {**base, "dataLayer": {"refreshInterval": "500ms"}}
    assert parse_config([slow]).data_layer.staleness_threshold == 10.0  # 20 x interval
    both = {**base, "dataLayer": {"stalenessThreshold": "3s"},
            "saturationDetector": {"metricsStalenessThreshold": "200ms"}}
    spec = parse_config([both])
    assert (spec.data_layer.staleness_threshold, spec.saturation.metrics_staleness) == (3.0, 0.2)
    router = build_endpoint_picker(both, static_pool(["127.0.0.1:1"]), EppMetrics()).router
    assert router.datalayer.staleness == 3.0  # type: ignore[attr-defined]
