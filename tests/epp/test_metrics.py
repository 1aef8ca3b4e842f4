"""The EPP's counted metrics serve exactly what prometheus_client's own metrics would."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import disable_created_metrics, enable_created_metrics

from kvswitch.epp.datalayer import Endpoint, EndpointSpec
from kvswitch.epp.metrics import EppMetrics

LABELS = ["model", "objective", "fairness_id", "endpoint", "status"]
NAMES = ("kvswitch_epp_scheduler_e2e_duration_seconds", "kvswitch_epp_requests_total",
         "kvswitch_epp_requests_created", "kvswitch_epp_endpoint_in_flight_requests",
         "kvswitch_epp_request_duration_seconds", "kvswitch_epp_endpoint_ready")
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)


def _without_created_values(text: str) -> str:
    # `_created` samples hold creation timestamps: compare that they exist, not their value.
    return re.sub(r"(_created(?:\{[^}]*\})?) \S+", r"\1 T", text)


def _reference(registry: CollectorRegistry
               ) -> tuple[Histogram, Counter, Gauge, Histogram, Gauge]:
    histogram = Histogram(
        "kvswitch_epp_scheduler_e2e_duration_seconds",
        "Time to run one scheduling cycle (filters, scorers, picker), excluding queueing.",
        buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5, 5.0, 10.0, 30.0), registry=registry)
    counter = Counter("kvswitch_epp_requests", "Routing decisions.", LABELS, registry=registry)
    durations = Histogram(
        "kvswitch_epp_request_duration_seconds",
        "Routed requests from the EPP seeing their headers to the end of the response.",
        ["model", "objective", "fairness_id", "endpoint"], buckets=REQUEST_BUCKETS,
        registry=registry)
    gauge = Gauge("kvswitch_epp_endpoint_in_flight_requests",
                  "Requests the EPP routed and not finished.", ["endpoint"], registry=registry)
    ready = Gauge("kvswitch_epp_endpoint_ready", "1 when the endpoint is eligible for scheduling.",
                  ["endpoint"], registry=registry)
    return histogram, counter, gauge, durations, ready


def _families(text: str, names: tuple[str, ...]) -> str:
    return "\n".join(line for line in text.splitlines()
                     if any(name in line for name in names))


@pytest.mark.parametrize("created", [True, False])
def test_counted_metrics_expose_what_prometheus_client_would(created: bool) -> None:
    if not created:
        disable_created_metrics()
    try:
        ours = EppMetrics()
        reference = CollectorRegistry()
        histogram, counter, gauge, durations, ready = _reference(reference)
        for value in (0.00005, 0.0001, 0.0003, 0.002, 0.2, 31.0, 0.0001):
            ours.scheduling_seconds.observe(value)
            histogram.observe(value)
        for labels, amount in ((("m", "", "default-flow", "10.0.0.1:8000", "200"), 1),
                               (("m", "", "default-flow", "10.0.0.1:8000", "200"), 1),
                               (("", "o", "t", "", "503"), 3)):
            ours.requests.inc(labels, amount)
            counter.labels(*labels).inc(amount)
        for labels, seconds in ((("m", "", "t", "10.0.0.1:8000"), 0.2),
                                (("m", "", "t", "10.0.0.1:8000"), 400.0),
                                (("m", "o", "u", "10.0.0.2:8000"), 0.005)):
            ours.request_seconds.observe(seconds, labels)
            durations.labels(*labels).observe(seconds)
        for address, count in (("10.0.0.1:8000", 2), ("10.0.0.2:8000", 0)):
            endpoint = Endpoint(EndpointSpec(address))
            endpoint.in_flight = count
            ours.in_flight.show(endpoint)
            gauge.labels(address).set(count)
        pool = [Endpoint(EndpointSpec(f"10.0.0.{i}:8000")) for i in (1, 2)]
        ours.endpoint_ready.track(pool, {"10.0.0.2:8000"})
        ready.labels("10.0.0.1:8000").set(0)
        ready.labels("10.0.0.2:8000").set(1)
        expected = _families(generate_latest(reference).decode(), NAMES)
        served = _families(generate_latest(ours.registry).decode(), NAMES)
    finally:
        enable_created_metrics()
    assert _without_created_values(served) == _without_created_values(expected)
    assert ("_created" in served) is created
    assert ours.requests.value("", "o", "t", "", "503") == 3.0
    assert ours.scheduling_seconds.count() == 7
    assert ours.request_seconds.count("m", "", "t", "10.0.0.1:8000") == 2


def test_unused_counted_metrics_expose_their_help_and_type() -> None:
    text = generate_latest(EppMetrics().registry).decode()
    assert "# TYPE kvswitch_epp_prompt_tokens_total counter" in text
    assert "# TYPE kvswitch_epp_endpoint_in_flight_requests gauge" in text
    assert "kvswitch_epp_scheduler_e2e_duration_seconds_count 0.0" in text


def test_the_default_registry_takes_the_counted_metrics_once() -> None:
    registry = CollectorRegistry(auto_describe=True)
    EppMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        EppMetrics(registry)


def test_the_in_flight_gauge_reads_the_endpoints_counts_at_scrape_time() -> None:
    metrics = EppMetrics()
    endpoint = Endpoint(EndpointSpec("10.0.0.1:8000"))
    metrics.in_flight.show(endpoint)
    endpoint.in_flight = 3
    text = generate_latest(metrics.registry).decode()
    assert 'kvswitch_epp_endpoint_in_flight_requests{endpoint="10.0.0.1:8000"} 3.0' in text
    assert metrics.in_flight.value("10.0.0.1:8000") == 3.0
    assert metrics.in_flight.value("10.0.0.2:8000") == 0.0


def test_the_in_flight_gauge_tracks_the_pool_and_busy_leavers() -> None:
    metrics = EppMetrics()
    idle, busy, leaver = (Endpoint(EndpointSpec(f"10.0.0.{i}:8000")) for i in (1, 2, 3))
    busy.in_flight, leaver.in_flight = 2, 1
    metrics.in_flight.track([idle, busy, leaver])
    text = generate_latest(metrics.registry).decode()
    assert 'kvswitch_epp_endpoint_in_flight_requests{endpoint="10.0.0.1:8000"} 0.0' in text
    metrics.in_flight.track([idle, busy])  # `leaver` left the pool with a request in flight
    assert metrics.in_flight.endpoints == {e.address: e for e in (idle, busy, leaver)}
    leaver.in_flight = 0
    metrics.in_flight.track([idle, busy])
    assert metrics.in_flight.endpoints == {e.address: e for e in (idle, busy)}


def test_the_endpoint_requests_gauge_reads_reports_and_unreported_sends_at_scrape_time() -> None:
    from kvswitch.epp.datalayer import Datalayer

    metrics = EppMetrics()
    datalayer = Datalayer()
    datalayer.set_endpoints([EndpointSpec("10.0.0.1:8000")])
    (endpoint,) = datalayer.all()
    metrics.endpoint_requests.track([endpoint])
    datalayer.push("10.0.0.1:8000", running=2, waiting=1, kv_usage=0.5, waiting_tokens=None,
                   ttl=2.5)
    datalayer.record_sent(endpoint, 100)
    text = generate_latest(metrics.registry).decode()
    for state, value in (("running", 2.0), ("waiting", 1.0), ("unreported", 1.0)):
        assert (f'kvswitch_epp_endpoint_requests{{endpoint="10.0.0.1:8000",state="{state}"}} '
                f"{value}") in text
    metrics.endpoint_requests.track([])  # the endpoint left the pool: its series go
    assert "10.0.0.1:8000" not in generate_latest(metrics.registry).decode()


def test_load_records_are_counted_per_engine_and_kind() -> None:
    from kvswitch.epp.kvindex import EventBatch, KvBlockIndex, KvEventSubscriber, LoadRecord

    metrics = EppMetrics()
    subscribers = {"10.0.0.1:8000": KvEventSubscriber("10.0.0.1:8000", KvBlockIndex())}
    metrics.load_records.watch(subscribers)
    load = LoadRecord(1, 0, None, 0.1, 0.0, 8, 1)
    subscriber = subscribers["10.0.0.1:8000"]
    for batch in (EventBatch(0, load=load, load_only=True), EventBatch(0, load=load),
                  EventBatch(1, load=load), EventBatch(1, load=load, load_only=True),
                  EventBatch(2)):  # (a batch without a load record counts nowhere)
        subscriber.handle(batch)
    text = generate_latest(metrics.registry).decode()
    assert 'kvswitch_epp_load_records_total{endpoint="10.0.0.1:8000",kind="batch"} 2.0' in text
    assert 'kvswitch_epp_load_records_total{endpoint="10.0.0.1:8000",kind="load_only"} 2.0' in text
    subscribers.clear()  # the subscription ended: its series go
    assert "10.0.0.1:8000" not in generate_latest(metrics.registry).decode()
