"""kvswitch's EPP metrics under llm-d's `llm_d_epp_*` names: values and labels as upstream's
docs/metrics.md has them, derived from kvswitch's own series at scrape time."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvswitch.epp.datalayer import Datalayer, EndpointSpec, Metrics
from kvswitch.epp.metrics import EppMetrics
from kvswitch.epp.upstream_metrics import UpstreamNames


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_request_and_pool_series_under_upstream_names() -> None:
    registry = CollectorRegistry()
    metrics = EppMetrics(registry)
    datalayer = Datalayer()
    datalayer.set_endpoints([EndpointSpec("10.0.0.1:8000"), EndpointSpec("10.0.0.2:8000")])
    datalayer.update("10.0.0.1:8000", Metrics(running=2, waiting=1, kv_usage=0.2))
    datalayer.update("10.0.0.2:8000", Metrics(running=4, waiting=3, kv_usage=0.6))
    UpstreamNames(metrics, datalayer, lambda: {"batch": -1}, "qwen3").register(registry)
    labels = ("qwen3", "batch", "tenant-a")
    metrics.requests.inc((*labels, "10.0.0.1:8000", "200"), 3)
    metrics.requests.inc((*labels, "10.0.0.2:8000", "200"))
    metrics.requests.inc((*labels, "", "503"))
    metrics.finished.inc((*labels, "10.0.0.1:8000", "false", "UNAVAILABLE"))
    metrics.finished.inc((*labels, "10.0.0.1:8000", "true", "OK"), 3)
    metrics.request_seconds.observe(0.3, (*labels, "10.0.0.1:8000"))
    metrics.request_seconds.observe(0.7, (*labels, "10.0.0.2:8000"))
    metrics.ready_endpoints.set(2)
    metrics.scheduling_seconds.observe(0.0002)
    got = _samples(registry)
    request = (("fairness_id", "tenant-a"), ("model_name", "qwen3"), ("priority", "-1"),
               ("target_model_name", "qwen3"))
    assert got[("llm_d_epp_request_total", request)] == 5
    with_code = lambda code: tuple(sorted((*request, ("error_code", code))))
    assert got[("llm_d_epp_request_error_total", with_code("503"))] == 1
    assert got[("llm_d_epp_request_error_total", with_code("UNAVAILABLE"))] == 1
    # Both endpoints' observations fold into one series with upstream's labels.
    assert got[("llm_d_epp_request_duration_seconds_count", request)] == 2
    assert got[("llm_d_epp_request_duration_seconds_sum", request)] == pytest.approx(1.0)
    assert got[("llm_d_epp_scheduler_e2e_duration_seconds_count", ())] == 1
    assert got[("llm_d_epp_ready_endpoints", ())] == 2
    pool = (("name", "qwen3"),)
    assert got[("llm_d_epp_average_running_requests", pool)] == 3
    assert got[("llm_d_epp_std_dev_running_requests", pool)] == 1
    assert got[("llm_d_epp_average_kv_cache_utilization", pool)] == pytest.approx(0.4)
    assert got[("llm_d_epp_average_queue_size", pool)] == 2
    assert got[("llm_d_epp_per_endpoint_queue_size",
                (("model_server_endpoint", "10.0.0.2:8000"), ("name", "qwen3")))] == 3
    # kvswitch's own names stay.
    assert got[("kvswitch_epp_pool_ready_endpoints", ())] == 2
