"""Prometheus metrics with vLLM's names and labels (served by `kvswitch.metrics_http`).

Gauges and counters are read from the engine (`load()`, `counters()`) at scrape time, so the
request path pays nothing for them; the latency histograms are observed by the servicer, once
per request or per streamed update. Labels are `model_name` and `engine` ("0", vLLM's engine
index), as vLLM labels them. `kvswitch_engine_load_pushes_total`, kvswitch's own, counts the
load pushes to several EPPs (docs/multi-epp.md).

Latency histograms (TTFT, inter-token latency, e2e, queue time) are in the engine's seconds
(`Engine.now`): SIMULATED seconds for the simulator, so that at any --time-scale they compare
with a real vLLM's (at time scale 1 they coincide with wall seconds). As in vLLM, a token is
timed when the engine produced it, not when a slow client read it; TTFT and e2e run from the
request's arrival at the servicer, queue time from arrival to the first scheduled step. An
engine without a clock is timed in wall seconds.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvswitch.engine.base import Engine

# vLLM's bucket boundaries, so dashboards built for vLLM read ours unchanged.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_LABELS = ("model_name", "engine")


class _EngineCollector(Collector):
    """Reads the engine's state at scrape time."""

    def __init__(self, engine: Engine, labels: tuple[str, str]):
        self.engine = engine
        self.labels = list(labels)

    def collect(self) -> Iterator[Metric]:
        load = self.engine.load()
        counters = self.engine.counters()
        card = self.engine.model
        yield self._gauge("vllm:num_requests_running",
                          "Number of requests in model execution batches.", load.running)
        yield self._gauge("vllm:num_requests_waiting",
                          "Number of requests waiting to be processed.", load.waiting)
        yield self._gauge("vllm:kv_cache_usage_perc",
                          "KV-cache usage. 1 means 100 percent usage.", load.token_usage)
        yield self._counter("vllm:prefix_cache_queries",
                            "Prefix cache queries, in terms of number of queried tokens.",
                            counters.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits",
                            "Prefix cache hits, in terms of number of cached tokens.",
                            counters.prefix_cache_hits)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                            counters.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            counters.generation_tokens)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the "
                            "engine.", counters.preemptions)
        yield self._counter("kvswitch_engine_load_pushes",
                            "Load pushes fired after a request arrived (each reaches every "
                            "KV-event subscriber whose last record it does not repeat).",
                            counters.load_pushes)
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=[*_LABELS, "finished_reason"])
        for reason in sorted({"stop", "length", "abort", *counters.requests_finished}):
            success.add_metric([*self.labels, reason], counters.requests_finished.get(reason, 0))
        yield success
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                 "CacheConfig", labels=[*_LABELS, "block_size", "num_gpu_blocks",
                                                        "enable_prefix_caching", "max_num_seqs",
                                                        "max_num_batched_tokens",
                                                        "max_model_len"])
        info.add_metric([*self.labels, str(card.block_size), str(load.total_blocks or
                                                                  card.num_gpu_blocks),
                         "True", str(card.max_num_seqs), str(card.max_num_batched_tokens),
                         str(card.max_model_len)], 1.0)
        yield info

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(_LABELS))
        family.add_metric(self.labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=list(_LABELS))
        family.add_metric(self.labels, value)
        return family


class EngineMetrics:
    """The metric registry of one engine process."""

    def __init__(self, engine: Engine, engine_index: str = "0"):
        self.registry = CollectorRegistry(auto_describe=False)
        labels = (engine.model.served_model_name, engine_index)
        self.registry.register(_EngineCollector(engine, labels))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=self.registry)

        # Bound children: observe() without a label lookup on the hot path.
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS).labels(*labels)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.",
                             _ITL_BUCKETS).labels(*labels)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             _REQUEST_BUCKETS).labels(*labels)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    _REQUEST_BUCKETS).labels(*labels)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
