"""Prometheus metrics of one frontend process (/metrics).

Recorded once per request, never per token, to keep the streaming path cheap. With
`--workers N` each worker counts its own requests; a scrape reaches whichever worker the kernel
hands the connection to, so sum over scrapes per `pid` label, or run one worker per port.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvswitch.frontend.generation import Usage

__all__ = ["CONTENT_TYPE_LATEST", "FrontendMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = {"pid": str(os.getpid())}
        self._requests = Counter(
            "kvswitch_frontend_requests", "HTTP requests by endpoint and status",
            ["endpoint", "status", "pid"], registry=self.registry)
        self._prompt_tokens = Counter(
            "kvswitch_frontend_prompt_tokens", "Prompt tokens sent to the target",
            ["pid"], registry=self.registry).labels(**labels)
        self._generation_tokens = Counter(
            "kvswitch_frontend_generation_tokens", "Tokens received from the target",
            ["pid"], registry=self.registry).labels(**labels)
        self._cached_tokens = Counter(
            "kvswitch_frontend_cached_prompt_tokens", "Prompt tokens the engine had cached",
            ["pid"], registry=self.registry).labels(**labels)
        self._ttft = Histogram(
            "kvswitch_frontend_time_to_first_token_seconds",
            "Request arrival to the first streamed token", ["pid"], buckets=_LATENCY_BUCKETS,
            registry=self.registry).labels(**labels)
        self._e2e = Histogram(
            "kvswitch_frontend_request_duration_seconds", "Request arrival to the last byte",
            ["endpoint", "pid"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._pid = labels["pid"]
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        children = self._children.get((endpoint, status))
        if children is None:  # labels() validates and locks: once per (endpoint, status)
            children = (self._requests.labels(endpoint, str(status), self._pid),
                        self._e2e.labels(endpoint, self._pid))
            self._children[(endpoint, status)] = children
        children[0].inc()
        children[1].observe(seconds)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def usage(self, usage: Usage) -> None:
        self._prompt_tokens.inc(usage.prompt_tokens)
        self._generation_tokens.inc(usage.completion_tokens)
        self._cached_tokens.inc(usage.cached_tokens)

    def render(self) -> bytes:
        data: bytes = generate_latest(self.registry)
        return data
