"""The EPP's Prometheus metrics (prometheus_client), prefixed `kvswitch_epp_`.

Upstream-like names where the meaning matches (scheduler e2e duration, request totals, token
counters, pool ready endpoints, flow-control queue size). Pass a fresh `CollectorRegistry` per
router in tests; `default_metrics()` registers one set in the global registry.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EppMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.scheduling_seconds = Histogram(
            "kvswitch_epp_scheduler_e2e_duration_seconds",
            "Time to run one scheduling cycle (filters, scorers, picker), excluding queueing.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_wait_seconds = Histogram(
            "kvswitch_epp_flow_control_request_queue_duration_seconds",
            "Time requests spent in flow-control queues.", buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter(
            "kvswitch_epp_requests", "Routing decisions.",
            ["model", "objective", "fairness_id", "endpoint", "status"], registry=r)
        self.finished = Counter(
            "kvswitch_epp_requests_finished", "Routed requests that ended, by outcome.",
            ["endpoint", "ok"], registry=r)
        self.prompt_tokens = Counter(
            "kvswitch_epp_prompt_tokens", "Prompt tokens of finished requests.",
            ["model", "endpoint"], registry=r)
        self.completion_tokens = Counter(
            "kvswitch_epp_completion_tokens", "Completion tokens of finished requests.",
            ["model", "endpoint"], registry=r)
        self.cached_tokens = Counter(
            "kvswitch_epp_cached_tokens", "Prompt tokens served from the engines' prefix caches.",
            ["model", "endpoint"], registry=r)
        self.in_flight = Gauge(
            "kvswitch_epp_endpoint_in_flight_requests", "Requests the EPP routed and not finished.",
            ["endpoint"], registry=r)
        self.endpoint_ready = Gauge(
            "kvswitch_epp_endpoint_ready", "1 when the endpoint is eligible for scheduling.",
            ["endpoint"], registry=r)
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
