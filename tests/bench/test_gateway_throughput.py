"""benchmarks/gateway_throughput.py's reading of the EPP's Prometheus counters."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from kvswitch.epp.metrics import LoadRecordsCounter
from tests.support.benchmarks import load_script
from tests.support.processes import free_port


@pytest.fixture
def epp_metrics() -> Iterator[tuple[int, dict[str, SimpleNamespace]]]:
    """A metrics endpoint exporting the EPP's load-record counter over live subscriber counts."""
    registry = CollectorRegistry()
    counter = LoadRecordsCounter("kvswitch_epp_load_records", "load records", registry)
    subscribers = {"10.0.0.1:8000": SimpleNamespace(batch_loads=7, load_only_records=3),
                   "10.0.0.2:8000": SimpleNamespace(batch_loads=1, load_only_records=5)}
    counter.watch(subscribers)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield port, subscribers
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_load_only_records_are_summed_over_endpoints_and_epps(
        epp_metrics: tuple[int, dict[str, SimpleNamespace]]) -> None:
    bench = load_script("gateway_throughput")
    port, subscribers = epp_metrics
    assert bench.scrape_counter(port, bench.LOAD_RECORDS_METRIC, 'kind="load_only"') == 8.0
    assert bench.scrape_counter(port, bench.LOAD_RECORDS_METRIC, 'kind="batch"') == 8.0
    subscribers["10.0.0.1:8000"].load_only_records += 4  # read live, at scrape time
    assert bench._load_only_records([port, port]) == 24.0  # two EPPs' endpoints, added up
