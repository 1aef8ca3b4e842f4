"""The Envoy clusters of kvswitch's bootstrap: the model servers' pool, the EPPs, the frontends.

The EPP cluster holds every EPP (health-checked; with several, least request and outlier
ejection, plus one cluster per EPP for its own access log). Each cluster may carry an upstream
TLS transport socket.

How the pool cluster honours the EPP's pick (`routing`), as measured on Envoy 1.40:

* `override-host` (default): a STATIC cluster of the pool's endpoints with the
  `envoy.load_balancing_policies.override_host` policy reading `x-gateway-destination-endpoint`
  and the `envoy.lb` metadata key. It splits a comma-separated list into the pick and its
  fallbacks; the route's retry policy (connect failure / refused stream / reset before request)
  moves to the next fallback on each retry, then to round robin. Endpoints must be known up
  front (the pool file); a pick outside the cluster falls back to round robin.
* `original-dst`: ORIGINAL_DST + CLUSTER_PROVIDED +
  `original_dst_lb_config.use_http_header` on the same header; any `ip:port` works, no endpoint
  list needed. Envoy parses the header as exactly one address: a comma list does not parse
  (`original_dst_host_invalid`) and the request fails with 503 "no healthy upstream", so with
  this cluster the EPP must send its first pick only, and fallbacks are not honoured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvswitch.protocol.headers import DESTINATION_ENDPOINT, DESTINATION_METADATA_NAMESPACE
from kvswitch.tls import UpstreamTls, envoy_upstream_tls

__all__ = ["EPP_CLUSTER", "EXT_PROC_SERVICE", "FRONTEND_CLUSTER", "H2C", "H2_OPTIONS",
           "POOL_CLUSTER", "FailureMode", "PoolTarget", "Routing", "epp_clusters",
           "epp_log_cluster", "pool_cluster", "socket_address", "split_address", "static_cluster"]

Routing = Literal["original-dst", "override-host"]
FailureMode = Literal["FailClose", "FailOpen"]

H2C = "kubernetes.io/h2c"
POOL_CLUSTER = "kvswitch_pool"
EPP_CLUSTER = "kvswitch_epp"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
FRONTEND_CLUSTER = "kvswitch_frontend"

_T = "type.googleapis.com/"
_HTTP_OPTIONS = _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_OVERRIDE_HOST = _T + "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
_ROUND_ROBIN = _T + "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"

# HTTP/2 windows: 1 MiB per stream, 16 MiB per connection. Big enough that a token stream or a
# long prompt never waits on WINDOW_UPDATE round trips; small enough to bound memory per client.
H2_OPTIONS = {
    "initial_stream_window_size": 1 << 20,
    "initial_connection_window_size": 16 << 20,
    "max_concurrent_streams": 4096,
}


@dataclass(frozen=True, slots=True)
class PoolTarget:
    """What Envoy needs to know about the model-server pool."""

    endpoints: tuple[str, ...]
    """`ip:port` of every replica (STATIC clusters; ORIGINAL_DST ignores it)."""
    app_protocol: str = H2C
    """`kubernetes.io/h2c` → HTTP/2 upstream; `http` → HTTP/1.1 upstream."""
    service: str = ""
    """`name:port` of a DNS name that resolves to every ready replica (a headless Service in
    Kubernetes): the cluster is STRICT_DNS over it, re-resolved every second, instead of the
    static `endpoints`."""


def socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def epp_clusters(epps: Sequence[str], failure_mode: FailureMode,
                  tls: UpstreamTls | None) -> list[dict[str, Any]]:
    """The ext_proc cluster of every EPP, health-checked when there are several or the pool
    fails open; with several, also one cluster per EPP for its own access log. With `tls`
    Envoy reaches every EPP over TLS."""
    cluster = static_cluster(EPP_CLUSTER, epps, http2=True)
    if len(epps) > 1 or failure_mode == "FailOpen":
        cluster.update(_epp_health_checks())
    clusters = [cluster]
    if len(epps) > 1:
        cluster["lb_policy"] = "LEAST_REQUEST"
        # A refused connection ejects the EPP at once, before the next health check notices.
        cluster["outlier_detection"] = {
            "split_external_local_origin_errors": True, "consecutive_local_origin_failure": 1,
            "interval": "1s", "base_ejection_time": "2s", "max_ejection_percent": 100,
        }
        clusters += [static_cluster(epp_log_cluster(i), [epp], http2=True)
                     for i, epp in enumerate(epps)]
    if tls is not None:
        for each in clusters:
            each["transport_socket"] = envoy_upstream_tls(tls)
    return clusters


def epp_log_cluster(index: int) -> str:
    return f"{EPP_CLUSTER}_{index}"


def _protocol_options(http2: bool) -> dict[str, Any]:
    http_config: dict[str, Any] = (
        {"http2_protocol_options": H2_OPTIONS} if http2 else {"http_protocol_options": {}}
    )
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": _HTTP_OPTIONS, "explicit_http_config": http_config,
    }}


def _load_assignment(name: str, addresses: Sequence[str]) -> dict[str, Any]:
    lb_endpoints = []
    for address in addresses:
        host, port = split_address(address)
        lb_endpoints.append({"endpoint": {"address": socket_address(host, port)}})
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints}]}


def static_cluster(name: str, addresses: Sequence[str], *, http2: bool) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": _load_assignment(name, addresses),
        "typed_extension_protocol_options": _protocol_options(http2),
        "circuit_breakers": _no_circuit_breaking(),
    }


def _epp_health_checks() -> dict[str, Any]:
    """Active gRPC health checks of the EPPs (every second; down after two failures, so one slow
    answer does not bypass it), and no panic routing (never spread over dead EPPs because most
    are dead). Failing open needs it: Envoy fails open only while no body chunk has gone to the
    EPP, which holds when the EPP is known down before a request starts (no healthy host: the
    ext_proc stream fails at once) rather than found down by a refused connection after the
    first chunk."""
    return {
        "health_checks": [{
            "timeout": "1s", "interval": "1s", "no_traffic_interval": "1s",
            "unhealthy_threshold": 2, "healthy_threshold": 1,
            "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
        }],
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
    }


def _no_circuit_breaking() -> dict[str, Any]:
    # Envoy's defaults (1024 requests / pending) would shed a benchmark before the EPP does;
    # admission is flow control's job.
    big = 1_000_000
    return {"thresholds": [{"max_connections": big, "max_pending_requests": big,
                            "max_requests": big, "max_retries": big}]}


def _replicas_cluster(pool: PoolTarget) -> dict[str, Any]:
    http2 = pool.app_protocol == H2C
    if not pool.service:
        return static_cluster(POOL_CLUSTER, pool.endpoints, http2=http2)
    cluster = static_cluster(POOL_CLUSTER, [pool.service], http2=http2)
    cluster.update(type="STRICT_DNS", dns_refresh_rate="1s", dns_lookup_family="V4_PREFERRED")
    return cluster


def pool_cluster(pool: PoolTarget, *, routing: Routing, round_robin: bool,
                 tls: UpstreamTls | None) -> dict[str, Any]:
    """The model servers' cluster: round robin, or honouring the EPP's pick by `routing`; over
    TLS with `tls`."""
    cluster = _pool_cluster_without_tls(pool, routing, round_robin)
    if tls is not None:
        alpn = "h2" if pool.app_protocol == H2C else "http/1.1"
        cluster["transport_socket"] = envoy_upstream_tls(tls, alpn=alpn)
    return cluster


def _pool_cluster_without_tls(pool: PoolTarget, routing: Routing, round_robin: bool
                              ) -> dict[str, Any]:
    http2 = pool.app_protocol == H2C
    if round_robin:
        return _replicas_cluster(pool)
    if routing == "override-host":
        cluster = _replicas_cluster(pool)
        del cluster["lb_policy"]
        cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": _OVERRIDE_HOST,
                "override_host_sources": [
                    {"header": DESTINATION_ENDPOINT},
                    {"metadata": {"key": DESTINATION_METADATA_NAMESPACE,
                                  "path": [{"key": DESTINATION_ENDPOINT}]}},
                ],
                # Only reached when the EPP set nothing usable; the EPP always sets a pick or
                # answers locally, so this is a safety net.
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {"@type": _ROUND_ROBIN},
                }}]},
            },
        }}]}
        return cluster
    return {
        "name": POOL_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "1s",
        "original_dst_lb_config": {"use_http_header": True,
                                   "http_header_name": DESTINATION_ENDPOINT},
        # Forget replicas nobody routes to after a while (they are re-created on demand).
        "cleanup_interval": "60s",
        "typed_extension_protocol_options": _protocol_options(http2),
        "circuit_breakers": _no_circuit_breaking(),
    }
