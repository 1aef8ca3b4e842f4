"""The EPP's Prometheus metrics (prometheus_client), prefixed `kvswitch_epp_`.

Upstream-like names where the meaning matches (scheduler e2e duration, request totals, token
counters, pool ready endpoints, flow-control queue size). Pass a fresh `CollectorRegistry` per
router in tests; `default_metrics()` registers one set in the global registry.

The metrics updated on every request (request and token counters, scheduling histogram) are
counted in plain dicts and exported by a custom collector at scrape time: a
prometheus_client child costs a `.labels()` lookup and a lock per update, several times per
request. They serve the same names, types, labels and values as prometheus_client's own
Counter/Gauge/Histogram would (a test compares the two expositions). The event loop is their
only writer; a scrape thread reads copies taken in one C call each (atomic under the GIL).
The in-flight gauge is not updated per request: it reads the endpoints' counts at scrape time,
and the router tells it the pool's endpoints on its gauge tick. The readiness gauge is set whole
on that tick, so an endpoint that left the pool loses its series there.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from typing import Literal, Protocol

import prometheus_client.metrics as _prometheus_metrics
from prometheus_client import REGISTRY, CollectorRegistry, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvswitch.epp.datalayer import Endpoint

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Whole requests, from a unary call's milliseconds to a long generation's minutes.
_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)
# Every per-request figure is broken down by these (the issue's "model, objective, fairness id
# and endpoint"); fairness ids are tenants, so their number sets these series' cardinality.
REQUEST_LABELS = ("model", "objective", "fairness_id", "endpoint")


def _use_created() -> bool:
    # prometheus_client's switch for `_created` series (PROMETHEUS_DISABLE_CREATED_SERIES).
    return bool(getattr(_prometheus_metrics, "_use_created", True))


class _Labelled(Collector):
    """A labelled metric kept as label values -> value in a plain dict, registered in
    `registry`; subclasses say how values change and how they are exported."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.values: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def value(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)


class CountedCounter(_Labelled):
    """A labelled counter; `inc` is one dict update."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self.created: dict[tuple[str, ...], float] = {}
        super().__init__(name, documentation, labelnames, registry)

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        values = self.values
        value = values.get(labels)
        if value is None:
            self.created[labels] = time.time()
            value = 0.0
        values[labels] = value + amount

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        values, created = self.values.copy(), self.created.copy()
        with_created = _use_created()
        for labels, value in values.items():
            family.add_metric(labels, value, created.get(labels) if with_created else None)
        yield family


class _EndpointGauge(Collector):
    """A gauge labelled by endpoint, registered in `registry`, whose values subclasses give at
    scrape time (`snapshot`: endpoint address -> value)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        registry.register(self)

    def snapshot(self) -> dict[str, float]:
        raise NotImplementedError

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=["endpoint"])]

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=["endpoint"])
        for address, value in self.snapshot().items():
            family.add_metric((address,), value)
        yield family


class InFlightGauge(_EndpointGauge):
    """The per-endpoint in-flight gauge, read at scrape time from the endpoints' own
    `in_flight` counts (the router keeps them): nothing to update per request. `track(pool)`
    (the router's gauge tick) exports every pool endpoint, 0 until picked; an endpoint that
    left the pool stays while requests routed to it are in flight, and goes at the first tick
    after they end. `show` adds one endpoint at once (a pick between ticks)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.endpoints: dict[str, Endpoint] = {}
        super().__init__(name, documentation, registry)

    def show(self, endpoint: Endpoint) -> None:
        self.endpoints[endpoint.address] = endpoint

    def track(self, pool: Iterable[Endpoint]) -> None:
        """Export exactly `pool`'s endpoints, and those shown before still busy."""
        endpoints = {address: e for address, e in self.endpoints.items() if e.in_flight}
        endpoints.update((e.address, e) for e in pool)  # a pool member wins its address
        self.endpoints = endpoints  # one rebinding: a scrape copies the old dict or the new

    def value(self, address: str) -> float:
        endpoint = self.endpoints.get(address)
        return 0.0 if endpoint is None else float(endpoint.in_flight)

    def snapshot(self) -> dict[str, float]:
        return {address: float(e.in_flight) for address, e in self.endpoints.copy().items()}


class ReadyGauge(_EndpointGauge):
    """The per-endpoint readiness gauge (1 eligible for scheduling, else 0). `track(pool, ready)`
    (the router's gauge tick) sets it whole: exactly `pool`'s endpoints are exported, so one that
    left the pool goes at the next tick instead of keeping its last value."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.values: dict[str, float] = {}
        super().__init__(name, documentation, registry)

    def track(self, pool: Iterable[Endpoint], ready: Container[str]) -> None:
        """Export `pool`'s endpoints: 1 for those whose address is in `ready`, else 0."""
        # One rebinding: a scrape copies the old dict or the new, never a half-updated one.
        self.values = {e.address: 1.0 if e.address in ready else 0.0 for e in pool}

    def value(self, address: str) -> float:
        return self.values.get(address, 0.0)

    def snapshot(self) -> dict[str, float]:
        return self.values.copy()


class EndpointRequestsGauge(Collector):
    """The requests each endpoint has as this EPP sees them, read at scrape time: `running` and
    `waiting` from the engine's latest load report (pushed or polled), `unreported` the requests
    this EPP sent there that no report covers yet. `track(pool)` (the router's gauge tick) sets
    the endpoints exported."""

    STATES = ("running", "waiting", "unreported")

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.endpoints: tuple[Endpoint, ...] = ()
        registry.register(self)

    def track(self, pool: Iterable[Endpoint]) -> None:
        self.endpoints = tuple(pool)

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=["endpoint", "state"])]

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=["endpoint", "state"])
        for endpoint in self.endpoints:
            metrics = endpoint.metrics
            for state, value in zip(self.STATES, (metrics.running, metrics.waiting,
                                                  endpoint.unreported_requests), strict=True):
                family.add_metric((endpoint.address, state), float(value))
        yield family


class LoadRecordCounts(Protocol):
    """What `LoadRecordsCounter` reads of one KV-event subscriber."""

    batch_loads: int
    load_only_records: int


class LoadRecordsCounter(Collector):
    """Load records received on the engines' KV-event streams, per endpoint and kind: `batch`
    (carried by an event batch) or `load_only` (a heartbeat or a load push), read at scrape time
    from the subscribers' own counts. A subscriber that left (its endpoint left the pool) takes
    its series with it."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.sources: list[Mapping[str, LoadRecordCounts]] = []
        registry.register(self)

    def watch(self, subscribers: Mapping[str, LoadRecordCounts]) -> None:
        """Export the counts of `subscribers` (address -> subscriber), a live mapping."""
        self.sources.append(subscribers)

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=["endpoint", "kind"])]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=["endpoint", "kind"])
        totals: dict[tuple[str, str], int] = {}
        for subscribers in self.sources:
            for address, subscriber in list(subscribers.items()):
                for kind, count in (("batch", subscriber.batch_loads),
                                    ("load_only", subscriber.load_only_records)):
                    totals[address, kind] = totals.get((address, kind), 0) + count
        for labels, count in totals.items():
            family.add_metric(labels, float(count))
        yield family


class BlockCounts(Protocol):
    """What `IndexGauge` reads of a prefix index."""

    @property
    def endpoints(self) -> tuple[str, ...]: ...

    def num_blocks(self, endpoint: str) -> int: ...

    def num_speculative(self, endpoint: str) -> int: ...

    def pending_prefill(self, endpoint: str) -> int: ...

    def expire(self) -> None: ...


IndexCount = Literal["num_blocks", "num_speculative", "pending_prefill"]
"""The `BlockCounts` method an `IndexGauge` reads."""


class IndexGauge(Collector):
    """One per-endpoint count of the EPP's prefix indexes, read at scrape time and summed over
    them: `count` names it, `num_blocks` (KV blocks held by the engines' KV events; EPPs that
    share a gateway see the same events, so their values agree within one KV-event batch),
    `num_speculative` (blocks routed there, or queued there by another EPP, that no KV event
    has confirmed yet) or `pending_prefill` (what is left to prefill of the uncached prompt
    tokens routed there); for these two, what has expired is dropped first."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry,
                 count: IndexCount = "num_blocks") -> None:
        self.name = name
        self.documentation = documentation
        self.indexes: list[BlockCounts] = []
        self.count = count
        registry.register(self)

    def watch(self, index: BlockCounts) -> None:
        self.indexes.append(index)

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=["endpoint"])]

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=["endpoint"])
        totals: dict[str, int] = {}
        for index in self.indexes:
            if self.count != "num_blocks":
                index.expire()
            count = getattr(index, self.count)
            for endpoint in index.endpoints:
                totals[endpoint] = totals.get(endpoint, 0) + count(endpoint)
        for endpoint, value in totals.items():
            family.add_metric((endpoint,), float(value))
        yield family


class CountedHistogram(Collector):
    """A histogram kept as per-bucket counts and a sum per label values; `observe` is a dict
    lookup, a bisect and two additions. Unlabelled unless `labelnames` are given."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = (*buckets, float("inf"))
        # label values -> [per-bucket counts, sum, created]; the unlabelled series always exists
        self.series: dict[tuple[str, ...], list] = {}
        if not self.labelnames:
            self.series[()] = [[0] * len(self.bounds), 0.0, time.time()]
        registry.register(self)

    def observe(self, value: float, labels: tuple[str, ...] = ()) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = [[0] * len(self.bounds), 0.0, time.time()]
        # `le` buckets: the first bound >= value.
        series[0][bisect.bisect_left(self.bounds, value)] += 1
        series[1] += value

    def count(self, *labels: str) -> int:
        series = self.series.get(labels)
        return 0 if series is None else sum(series[0])

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with_created = _use_created()
        for labels, (counts, total, created) in list(self.series.items()):
            buckets, acc = [], 0.0
            for bound, count in zip(self.bounds, counts.copy(), strict=True):
                acc += count
                buckets.append((floatToGoString(bound), acc))
            family.add_metric(list(labels), buckets, total)
            if with_created:
                family.add_sample(self.name + "_created", dict(zip(self.labelnames, labels)),
                                  created)
        yield family


class EppMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.scheduling_seconds = CountedHistogram(
            "kvswitch_epp_scheduler_e2e_duration_seconds",
            "Time to run one scheduling cycle (filters, scorers, picker), excluding queueing.",
            _LATENCY_BUCKETS, r)
        self.queue_wait_seconds = Histogram(
            "kvswitch_epp_flow_control_request_queue_duration_seconds",
            "Time requests spent in flow-control queues.", buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = CountedCounter(
            "kvswitch_epp_requests", "Routing decisions.",
            ["model", "objective", "fairness_id", "endpoint", "status"], r)
        self.finished = CountedCounter(
            "kvswitch_epp_requests_finished",
            "Routed requests that ended, by outcome (ok) and status: the gRPC status name for "
            "gRPC requests, else the HTTP status; 'unknown' if the stream ended first.",
            [*REQUEST_LABELS, "ok", "status"], r)
        self.request_seconds = CountedHistogram(
            "kvswitch_epp_request_duration_seconds",
            "Routed requests from the EPP seeing their headers to the end of the response.",
            _REQUEST_BUCKETS, r, REQUEST_LABELS)
        self.prompt_tokens = CountedCounter(
            "kvswitch_epp_prompt_tokens",
            "Prompt tokens of finished requests (the usage trailer; else, for tokenized input "
            "answered OK, the prompt's length).", REQUEST_LABELS, r)
        self.completion_tokens = CountedCounter(
            "kvswitch_epp_completion_tokens", "Completion tokens of finished requests.",
            REQUEST_LABELS, r)
        self.cached_tokens = CountedCounter(
            "kvswitch_epp_cached_tokens", "Prompt tokens served from the engines' prefix caches.",
            REQUEST_LABELS, r)
        self.in_flight = InFlightGauge(
            "kvswitch_epp_endpoint_in_flight_requests", "Requests the EPP routed and not finished.",
            r)
        self.endpoint_ready = ReadyGauge(
            "kvswitch_epp_endpoint_ready", "1 when the endpoint is eligible for scheduling.", r)
        self.indexed_blocks = IndexGauge(
            "kvswitch_epp_indexed_kv_blocks",
            "KV blocks the endpoint holds according to the EPP's prefix index (KV events).", r)
        self.speculative_blocks = IndexGauge(
            "kvswitch_epp_speculative_kv_blocks",
            "KV blocks the EPP's prefix index holds speculatively on the endpoint: routed there "
            "(by this EPP, or by another as the engine's queued prompts say) and not yet "
            "confirmed by a KV event.", r, count="num_speculative")
        self.pending_prefill = IndexGauge(
            "kvswitch_epp_pending_prefill_tokens",
            "What is left to prefill, by the KV events, of the uncached prompt tokens routed to "
            "the endpoint (by this EPP, or by another as the engine's queued prompts say).", r,
            count="pending_prefill")
        self.endpoint_requests = EndpointRequestsGauge(
            "kvswitch_epp_endpoint_requests",
            "Requests on the endpoint as the EPP sees them: running and waiting from the "
            "engine's latest load report, unreported = sent by this EPP and in no report yet.", r)
        self.load_records = LoadRecordsCounter(
            "kvswitch_epp_load_records",
            "Load records received on the endpoint's KV-event stream, by kind: batch (with "
            "KV events) or load_only (a heartbeat, or a load push after a request arrived).", r)
        self.ready_endpoints = Gauge(
            "kvswitch_epp_pool_ready_endpoints", "Endpoints eligible for scheduling.", registry=r)
        self.loop_lag_seconds = Histogram(
            "kvswitch_epp_event_loop_lag_seconds",
            "How late the event loop ran a timer due now (every ext_proc reply waits as long).",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.loop_lag_max_seconds = Gauge(
            "kvswitch_epp_event_loop_lag_max_seconds",
            "The largest event-loop lag over the last gauge interval.", registry=r)
        self.queue_size = Gauge(
            "kvswitch_epp_flow_control_queue_size", "Requests waiting in flow control.",
            ["priority", "fairness_id"], registry=r)


_default: EppMetrics | None = None


def default_metrics() -> EppMetrics:
    """One metrics set in prometheus_client's global REGISTRY (what `/metrics` serves)."""
    global _default
    if _default is None:
        _default = EppMetrics(REGISTRY)
    return _default
