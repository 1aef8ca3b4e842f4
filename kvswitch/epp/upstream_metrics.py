"""kvswitch's EPP metrics under llm-d's names too (`llm_d_epp_*`, llm-d-router docs/metrics.md).

`UpstreamNames` is a scrape-time collector: it reads kvswitch's own families and the datalayer and
re-exports what has the same meaning under upstream's names and labels, so llm-d's dashboards
work against kvswitch; nothing is counted twice per request. Request-level series carry
upstream's labels `{model_name, target_model_name, fairness_id, priority}` (kvswitch does not
rewrite models, so target_model_name = model_name; priority is the request's InferenceObjective
priority). Exported:

- `request_total`, `request_error_total{error_code}` (routing refusals by their HTTP status, then
  routed requests that ended not ok by their gRPC or HTTP status), `request_duration_seconds`;
- `request_running` (requests routed and not finished), `ready_endpoints`;
- `scheduler_e2e_duration_seconds`, `flow_control_queue_size{fairness_id, priority}`;
- `average_` / `std_dev_` of `kv_cache_utilization`, `queue_size` and `running_requests` over
  the pool's endpoints (population standard deviation), `per_endpoint_queue_size{name,
  model_server_endpoint}`.
Upstream's token-count histograms have no source here (kvswitch counts tokens, it does not keep
their per-request distribution), so they are not exported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvswitch.epp.datalayer import Datalayer
from kvswitch.epp.metrics import EppMetrics

PREFIX = "llm_d_epp_"
REQUEST_LABELS = ("model_name", "target_model_name", "fairness_id", "priority")

Labels = tuple[str, ...]


def _samples(collector: Any, suffix: str) -> Iterator[tuple[dict[str, str], float]]:
    for family in collector.collect():
        for sample in family.samples:
            if sample.name == family.name + suffix:
                yield sample.labels, sample.value


class UpstreamNames(Collector):
    """Register with `register(registry)`; see the module docstring."""

    def __init__(self, metrics: EppMetrics, datalayer: Datalayer | None = None,
                 priorities: Callable[[], Mapping[str, int]] = dict,
                 pool_name: str = "") -> None:
        self.metrics = metrics
        self.datalayer = datalayer
        self.priorities = priorities
        self.pool_name = pool_name

    def register(self, registry: CollectorRegistry) -> UpstreamNames:
        registry.register(self)
        return self

    def describe(self) -> list[Metric]:
        return []  # (collected at scrape time only; names need no check at registration)

    def _request_labels(self, labels: Mapping[str, str]) -> Labels:
        objective = labels.get("objective", "")
        priority = self.priorities().get(objective, 0) if objective else 0
        model = labels.get("model", "")
        return (model, model, labels.get("fairness_id", ""), str(priority))

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        totals: dict[Labels, float] = {}
        errors: dict[Labels, float] = {}
        for labels, value in _samples(m.requests, "_total"):
            key = self._request_labels(labels)
            totals[key] = totals.get(key, 0.0) + value
            if labels.get("status") != "200":
                error = (*key, labels.get("status", ""))
                errors[error] = errors.get(error, 0.0) + value
        for labels, value in _samples(m.finished, "_total"):
            if labels.get("ok") == "false":
                error = (*self._request_labels(labels), labels.get("status", ""))
                errors[error] = errors.get(error, 0.0) + value
        yield _counter("request_total", "Total requests.", REQUEST_LABELS, totals)
        yield _counter("request_error_total", "Errored requests.", (*REQUEST_LABELS, "error_code"),
                       errors)
        yield self._histogram(m.request_seconds, "request_duration_seconds",
                              "End-to-end request latency.", self._request_labels,
                              REQUEST_LABELS)
        yield self._histogram(m.scheduling_seconds, "scheduler_e2e_duration_seconds",
                              "End-to-end scheduling latency.", lambda _: (), ())
        running = sum(value for _, value in _samples(m.in_flight, ""))
        yield _gauge("request_running", "Requests currently in flight.", running)
        ready = sum(value for _, value in _samples(m.ready_endpoints, ""))
        yield _gauge("ready_endpoints", "Ready endpoints in the pool.", ready)
        queue = GaugeMetricFamily(PREFIX + "flow_control_queue_size",
                                  "Requests waiting in flow control.",
                                  labels=["fairness_id", "priority"])
        for labels, value in _samples(m.queue_size, ""):
            queue.add_metric([labels.get("fairness_id", ""), labels.get("priority", "")], value)
        yield queue
        yield from self._pool_gauges()

    def _histogram(self, source: Any, name: str, documentation: str,
                   relabel: Callable[[Mapping[str, str]], Labels],
                   labelnames: Labels) -> Metric:
        """`source`'s histogram summed over the labels `relabel` drops."""
        buckets: dict[Labels, dict[str, float]] = {}
        sums: dict[Labels, float] = {}
        for family in source.collect():
            for sample in family.samples:
                if sample.name == family.name + "_bucket":
                    labels = dict(sample.labels)
                    le = labels.pop("le")
                    per = buckets.setdefault(relabel(labels), {})
                    per[le] = per.get(le, 0.0) + sample.value
                elif sample.name == family.name + "_sum":
                    key = relabel(sample.labels)
                    sums[key] = sums.get(key, 0.0) + sample.value
        family = HistogramMetricFamily(PREFIX + name, documentation, labels=list(labelnames))
        for key, per in buckets.items():
            ordered = sorted(per.items(), key=lambda item: float(item[0]))
            family.add_metric(list(key), ordered, sums.get(key, 0.0))
        return family

    def _pool_gauges(self) -> Iterable[Metric]:
        endpoints = self.datalayer.all() if self.datalayer is not None else []
        figures = {
            "kv_cache_utilization": [e.metrics.kv_usage for e in endpoints],
            "queue_size": [float(e.metrics.waiting) for e in endpoints],
            "running_requests": [float(e.metrics.running) for e in endpoints],
        }
        for what, values in figures.items():
            mean = sum(values) / len(values) if values else 0.0
            spread = (math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
                      if values else 0.0)
            yield _gauge(f"average_{what}", f"Mean {what.replace('_', ' ')} across the pool.",
                         mean, name=self.pool_name)
            yield _gauge(f"std_dev_{what}", f"Spread of {what.replace('_', ' ')} across the pool.",
                         spread, name=self.pool_name)
        per = GaugeMetricFamily(PREFIX + "per_endpoint_queue_size", "Per-endpoint queue depth.",
                                labels=["name", "model_server_endpoint"])
        for endpoint in endpoints:
            per.add_metric([self.pool_name, endpoint.address], float(endpoint.metrics.waiting))
        yield per


def _counter(name: str, documentation: str, labelnames: Labels,
             values: Mapping[Labels, float]) -> Metric:
    family = CounterMetricFamily(PREFIX + name.removesuffix("_total"), documentation,
                                 labels=list(labelnames))
    for labels, value in values.items():
        family.add_metric(list(labels), value)
    return family


def _gauge(metric: str, documentation: str, value: float, **labels: str) -> Metric:
    family = GaugeMetricFamily(PREFIX + metric, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family
