"""The EPP's data layer: endpoints, discovery, and the collectors that keep their load fresh."""

from __future__ import annotations

from kvswitch.epp.datalayer.collectors import (
    Collector,
    CollectorError,
    GrpcCollector,
    PrometheusCollector,
    parse_prometheus,
)
from kvswitch.epp.datalayer.discovery import Discovery, StaticDiscovery
from kvswitch.epp.datalayer.endpoint import (
    H2C,
    HTTP,
    AppProtocol,
    Datalayer,
    Endpoint,
    EndpointSpec,
    Metrics,
)
from kvswitch.epp.datalayer.refresher import Refresher, default_collector

__all__ = [
    "H2C",
    "HTTP",
    "AppProtocol",
    "Collector",
    "CollectorError",
    "Datalayer",
    "Discovery",
    "Endpoint",
    "EndpointSpec",
    "GrpcCollector",
    "Metrics",
    "PrometheusCollector",
    "Refresher",
    "StaticDiscovery",
    "default_collector",
    "parse_prometheus",
]
