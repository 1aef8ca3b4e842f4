"""The Envoy bootstrap kvswitch runs: one listener, HTTP/1.1 and h2c, routed by the EPP.

Three shapes, all from `GatewayOptions`:

* **kvswitch** (default): `header_mutation` (drop any client-supplied destination header) →
  `set_metadata` (mark the request as logged to the EPP) → `ext_proc` (the EPP: request headers
  + full-duplex request body in, the mark with them; only the headers it reads, `EPP_HEADERS`;
  no response message) → `router` to the pool cluster. The access log of marked requests
  streams to the EPP (`http_grpc`, flushed every 50 ms): it tells the EPP how each request
  ended, so the ext_proc stream closes once the request is routed (response headers and
  trailers SKIP) and neither the response's end nor an EPP restart depends on it
  (kvswitch.epp.access_log).
* **several EPPs** (`epps` lists more than one): the ext_proc cluster holds them all (least
  request, gRPC health checks and outlier ejection move new streams off a dead one within about
  a second, and a stream that fails to start is retried on another host); each EPP signs the
  requests it routes (`envoy.lb` metadata `x-kvswitch-epp-replica`, its `--replica-name`, which
  must be its address as listed here) and gets its own access logger, filtered on that
  signature, so each EPP receives the log entries of its own requests and no others.
* **with a frontend**: HTTP OpenAI paths (`/v1/*`, `/health`) go to a STATIC cluster of frontend
  processes with ext_proc disabled on that route; the frontend calls back into this same listener
  over gRPC with tokenized input, and that call goes through the EPP.
* **round robin** (`round_robin=True`): no ext_proc; a STATIC ROUND_ROBIN cluster of the engines.
  The benchmarks' "Envoy round robin" baseline.

TLS, each hop on its own: `tls` on the listener (a client must finish its handshake within
`tls.handshake_timeout`), `epp_tls` to the EPPs, `engine_tls` to the pool (ALPN h2, or
http/1.1 for an HTTP pool) and `frontend_tls` to the frontends (http/1.1).

The clusters, and how the pool cluster honours the EPP's pick, are `kvswitch.envoy.clusters`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvswitch.envoy.clusters import (
    EPP_CLUSTER,
    FRONTEND_CLUSTER,
    H2_OPTIONS,
    POOL_CLUSTER,
    FailureMode,
    PoolTarget,
    Routing,
    epp_clusters,
    epp_log_cluster,
    pool_cluster,
    socket_address,
    static_cluster,
)
from kvswitch.limits import HTTP_DEFAULTS, HttpLimits
from kvswitch.protocol.headers import (
    ACCESS_LOGGED,
    DESTINATION_ENDPOINT,
    DESTINATION_METADATA_NAMESPACE,
    EPP_REPLICA,
    GATEWAY_METADATA_NAMESPACE,
    REQUEST_ID,
    SERVED_ENDPOINT,
    SESSION_TOKEN,
    USAGE_TRAILER,
)
from kvswitch.tls import TlsFiles, UpstreamTls, envoy_downstream_tls, envoy_upstream_tls

__all__ = ["EPP_HEADERS", "FailureMode", "GatewayOptions", "PoolTarget", "Routing",
           "build_bootstrap"]



_T = "type.googleapis.com/"
_HCM = _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_EXT_PROC_PER_ROUTE = _T + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
_HEADER_MUTATION = _T + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
_ROUTER = _T + "envoy.extensions.filters.http.router.v3.Router"
_STDOUT_LOG = _T + "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog"
_GRPC_LOG = _T + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"
_FILTER_CONFIG = _T + "envoy.config.route.v3.FilterConfig"
_SET_METADATA = _T + "envoy.extensions.filters.http.set_metadata.v3.Config"
# How often Envoy sends the EPP its buffered log entries (sooner when 16 KiB are buffered): how
# late, at most, a request's in-flight count ends after its response did.
ACCESS_LOG_FLUSH_SECONDS = 0.05
ACCESS_LOG_FLUSH = f"{ACCESS_LOG_FLUSH_SECONDS}s"



# The headers the EPP reads (the parsers, the endpoint-picker protocol's and llm-d's headers,
# the session-affinity-scorer's default; on the response side, if response messages are sent,
# the status and usage), the only ones Envoy sends it; a trailing `*` is a prefix. An ext_proc
# message then carries ~4 headers instead of ~11: less for Envoy to serialize and for the EPP to
# parse and copy into a dict per request. (Envoy applies the rules to response headers and
# trailers too.)
EPP_HEADERS = (":path", "content-type", "content-length", "grpc-encoding", REQUEST_ID,
               SESSION_TOKEN, "x-llm-d-*", "x-gateway-*", ":status", "grpc-status", USAGE_TRAILER)



@dataclass(frozen=True, slots=True)
class GatewayOptions:
    pool: PoolTarget
    epps: tuple[str, ...] = ("127.0.0.1:9002",)
    """The EPPs' ext_proc `host:port`s; ignored when `round_robin`. With more than one, each EPP
    runs with `--replica-name` set to its address as written here."""
    port: int = 8000
    host: str = "127.0.0.1"
    admin_port: int = 9901
    frontends: Sequence[str] = ()
    """OpenAI frontend processes (`host:port`), served on `/v1/*` and `/health`."""
    round_robin: bool = False
    routing: Routing = "override-host"
    message_timeout_s: float = 40.0
    """How long ext_proc waits for each EPP reply. The EPP holds the headers reply until it has
    parsed the body and scheduled, which includes flow-control queueing: keep it above the flow
    control queue's max wait (30 s by default), so the EPP's own 503 arrives first."""
    fallback_retries: int = 2
    """Retries onto fallback endpoints (`override-host` routing only)."""
    access_log: bool = False
    frontend_paths: tuple[str, ...] = field(default=("/v1/", "/health", "/tokenize",
                                                    "/detokenize"))
    epp_failure_mode: FailureMode = "FailClose"
    """The InferencePool's endpointPickerRef.failureMode: `FailOpen` routes requests the EPP
    cannot answer (unreachable, broken) by the pool cluster's own round robin; `FailClose`
    answers them 503 / UNAVAILABLE."""
    report_served_endpoint: bool = False
    """Add `x-gateway-destination-endpoint-served: ip:port` (the replica that served it) to
    every pool response."""
    epp_headers: tuple[str, ...] | None = EPP_HEADERS
    """Headers sent to the EPP (a trailing `*`: a prefix); None: all of them. Add any request
    header an EPP plugin reads, e.g. a session-affinity-scorer's own `headerName`."""
    http_limits: HttpLimits = HTTP_DEFAULTS
    """Downstream limits, as the frontend applies them: the head's size (KiB, rounded up) and
    field count (431), `head_timeout` for the whole head (Envoy's request_headers_timeout:
    408)."""
    tls: TlsFiles | None = None
    """TLS on the listener (mTLS with a client CA); None: plaintext."""
    epp_tls: UpstreamTls | None = None
    """Call the EPP over TLS (mTLS with a client certificate); None: h2c."""
    engine_tls: UpstreamTls | None = None
    """Call the pool's engines over TLS (mTLS with a client certificate); None: plaintext."""
    frontend_tls: UpstreamTls | None = None
    """Call the frontends over TLS (HTTPS); None: HTTP."""
    request_timeout_s: float = 120.0
    """Envoy's request_timeout: the whole request must be received (routing, and so the EPP's
    flow-control wait, included) within it; a response already started disarms it."""


def build_bootstrap(options: GatewayOptions) -> dict[str, Any]:
    """The bootstrap as a plain dict (render with JSON or YAML)."""
    clusters = [pool_cluster(options.pool, routing=options.routing,
                             round_robin=options.round_robin, tls=options.engine_tls)]
    if not options.round_robin:
        if not options.epps:
            raise ValueError("an EPP address is required unless round_robin is set")
        if len(set(options.epps)) != len(options.epps):
            raise ValueError(f"EPP addresses repeat: {', '.join(options.epps)}")
        clusters += epp_clusters(options.epps, options.epp_failure_mode, options.epp_tls)
    if options.frontends:
        frontends = static_cluster(FRONTEND_CLUSTER, list(options.frontends), http2=False)
        if options.frontend_tls is not None:
            frontends["transport_socket"] = envoy_upstream_tls(options.frontend_tls,
                                                               alpn="http/1.1")
        clusters.append(frontends)
    return {
        "admin": {"address": socket_address("127.0.0.1", options.admin_port)},
        "static_resources": {"listeners": [_listener(options)], "clusters": clusters},
        # Loopback gateway: no overload manager, but cap downstream connections sanely.
        "layered_runtime": {"layers": [{"name": "static", "static_layer": {
            "overload": {"global_downstream_max_connections": 50000},
        }}]},
    }




def _listener(options: GatewayOptions) -> dict[str, Any]:
    limits = options.http_limits
    hcm: dict[str, Any] = {
        "@type": _HCM,
        "stat_prefix": "kvswitch",
        # AUTO: HTTP/1.1 (curl, OpenAI SDK) and prior-knowledge h2c (gRPC) on the same port.
        "codec_type": "AUTO",
        "http2_protocol_options": H2_OPTIONS,
        # Token streams may sit idle through a long prefill; only a dead peer should end them.
        "stream_idle_timeout": "3600s",
        "request_timeout": f"{options.request_timeout_s:g}s",
        "request_headers_timeout": f"{limits.head_timeout:g}s",
        "max_request_headers_kb": -(-limits.max_header_bytes // 1024),
        # Envoy's own idle timeout (1 h) stays: clients pool connections to the gateway, and
        # one closed under them after a short idle would fail their next request.
        "common_http_protocol_options": {"max_headers_count": limits.max_headers},
        "route_config": _route_config(options),
        "http_filters": _http_filters(options),
        # The request id the EPP and engines log; Envoy generates it when the client sends none.
        "generate_request_id": True,
    }
    access_logs: list[dict[str, Any]] = []
    if options.access_log:
        access_logs.append({"name": "envoy.access_loggers.stdout",
                            "typed_config": {"@type": _STDOUT_LOG}})
    if not options.round_robin:
        access_logs += _epp_access_logs(options.epps)
    if access_logs:
        hcm["access_log"] = access_logs
    chain: dict[str, Any] = {"filters": [{
        "name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
    if options.tls is not None:
        chain["transport_socket"] = envoy_downstream_tls(options.tls)
        chain["transport_socket_connect_timeout"] = f"{options.tls.handshake_timeout:g}s"
    return {"name": "kvswitch", "address": socket_address(options.host, options.port),
            "filter_chains": [chain]}




def _epp_access_logs(epps: Sequence[str]) -> list[dict[str, Any]]:
    if len(epps) == 1:
        return [_epp_access_log(EPP_CLUSTER, None)]
    return [_epp_access_log(epp_log_cluster(i), epp) for i, epp in enumerate(epps)]


def _epp_access_log(cluster: str, replica: str | None) -> dict[str, Any]:
    """The entries of requests an EPP routed, to that EPP: marked by `set_metadata`, and given a
    destination by the EPP (`envoy.lb` metadata) — by the EPP named `replica`, when several
    share the gateway. Requests it answered itself (shed, nothing ready, bad input) are left
    out: it has nothing waiting for them, and under overload they would be most of the
    entries."""
    marked = {"filter": GATEWAY_METADATA_NAMESPACE, "path": [{"key": ACCESS_LOGGED}],
              "value": {"bool_match": True}}
    routed = {"filter": DESTINATION_METADATA_NAMESPACE, "path": [{"key": DESTINATION_ENDPOINT}],
              "value": {"present_match": True}}
    matchers = [marked, routed]
    if replica is not None:
        matchers.append({"filter": DESTINATION_METADATA_NAMESPACE,
                         "path": [{"key": EPP_REPLICA}],
                         "value": {"string_match": {"exact": replica}}})
    return {
        "name": "envoy.access_loggers.http_grpc",
        # (A metadata filter logs requests without the key unless told not to.)
        "filter": {"and_filter": {"filters": [
            {"metadata_filter": {"matcher": m, "match_if_key_not_found": False}}
            for m in matchers
        ]}},
        "typed_config": {
            "@type": _GRPC_LOG,
            "common_config": {
                "log_name": "kvswitch",
                "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                "transport_api_version": "V3",
                "buffer_flush_interval": ACCESS_LOG_FLUSH,
            },
            # grpc-status: in the trailers, or the headers of a trailers-only error reply.
            "additional_response_headers_to_log": ["grpc-status"],
            "additional_response_trailers_to_log": ["grpc-status", USAGE_TRAILER],
        },
    }


def _route_config(options: GatewayOptions) -> dict[str, Any]:
    routes: list[dict[str, Any]] = []
    if options.frontends:
        # The frontend's own HTTP requests are not routed by the EPP (its gRPC calls back into
        # this listener are): no ext_proc, and no mark, so they are not logged to the EPP.
        no_ext_proc = {
            "envoy.filters.http.ext_proc": {"@type": _EXT_PROC_PER_ROUTE, "disabled": True},
            "envoy.filters.http.set_metadata": {"@type": _FILTER_CONFIG, "disabled": True},
        }
        for path in options.frontend_paths:
            match = {"prefix": path} if path.endswith("/") else {"path": path}
            routes.append({
                "match": match,
                "route": {"cluster": FRONTEND_CLUSTER, "timeout": "0s"},
                "typed_per_filter_config": no_ext_proc,
            })
    pool_route: dict[str, Any] = {"cluster": POOL_CLUSTER, "timeout": "0s"}
    if options.routing == "override-host" and not options.round_robin:
        pool_route["retry_policy"] = {
            # Only failures where the replica certainly did no work: safe to replay elsewhere.
            "retry_on": "connect-failure,refused-stream,reset-before-request",
            "num_retries": options.fallback_retries,
        }
    route: dict[str, Any] = {"match": {"prefix": "/"}, "route": pool_route}
    if options.report_served_endpoint:
        # The replica that actually served the request (GAIE's served-endpoint report), for
        # clients that check the gateway honoured the pick; it names pod addresses, so opt-in.
        route["response_headers_to_add"] = [{
            "header": {"key": SERVED_ENDPOINT, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    routes.append(route)
    return {"name": "kvswitch", "virtual_hosts": [
        {"name": "kvswitch", "domains": ["*"], "routes": routes},
    ]}


def _http_filters(options: GatewayOptions) -> list[dict[str, Any]]:
    router = {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}
    if options.round_robin:
        return [router]
    strip_destination = {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {"@type": _HEADER_MUTATION, "mutations": {"request_mutations": [
            # A client must never choose its replica: drop the header before the EPP sets it.
            {"remove": DESTINATION_ENDPOINT},
        ]}},
    }
    # Tells the EPP that this gateway logs the request to it; dynamic metadata, so no client can
    # claim it (a forged claim would hold a request in flight waiting for a log entry).
    mark_logged = {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {"@type": _SET_METADATA, "metadata": [{
            "metadata_namespace": GATEWAY_METADATA_NAMESPACE,
            "value": {ACCESS_LOGGED: True},
        }]},
    }
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _EXT_PROC,
            "grpc_service": _ext_proc_service(options.epps),
            "failure_mode_allow": options.epp_failure_mode == "FailOpen",
            "allow_mode_override": False,
            "message_timeout": f"{options.message_timeout_s:g}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                # Full-duplex body mode requires trailers to be sent; gRPC clients send none,
                # so nothing extra reaches the EPP in practice.
                "request_trailer_mode": "SEND",
                # The access log brings status, usage and the end, so no response message at
                # all: the ext_proc stream closes once the request is routed (~7 % less EPP CPU
                # per streamed request; an EPP restart leaves responses in flight alone). HTTP
                # pools too: an HTTP response's headers come before its body, so the EPP waited
                # for the log entry all the same, and the headers' round trip bought nothing.
                "response_header_mode": "SKIP",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP",
            },
            "metadata_options": {
                "forwarding_namespaces": {"untyped": [GATEWAY_METADATA_NAMESPACE]},
                "receiving_namespaces": {"untyped": [DESTINATION_METADATA_NAMESPACE]},
            },
            # The route does not depend on anything the EPP sets: skip re-matching it.
            "disable_clear_route_cache": True,
            **_forward_rules(options.epp_headers),
            # EPP unreachable or broken: the caller sees 503 / UNAVAILABLE, not 500.
            "status_on_error": {"code": "ServiceUnavailable"},
        },
    }
    return [strip_destination, mark_logged, ext_proc, router]


def _ext_proc_service(epps: Sequence[str]) -> dict[str, Any]:
    service: dict[str, Any] = {"envoy_grpc": {"cluster_name": EPP_CLUSTER}}
    if len(epps) > 1:
        # A stream that cannot start on one EPP (killed, restarting) starts on another.
        service["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset-before-request,reset",
            "num_retries": len(epps) - 1,
            "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.05s"},
            "retry_host_predicate": [{
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": _T + "envoy.extensions.retry.host.previous_hosts.v3"
                                              ".PreviousHostsPredicate"},
            }],
            # Least request favours a dead EPP until it is ejected (its streams are gone), and
            # after the default one reselection Envoy retries on the host it rejected.
            "host_selection_retry_max_attempts": 20,
        }
    return service


def _forward_rules(headers: Sequence[str] | None) -> dict[str, Any]:
    """ext_proc `forward_rules` sending only `headers` (pseudo-headers included) to the EPP."""
    if headers is None:
        return {}
    patterns = [{"prefix": name[:-1]} if name.endswith("*") else {"exact": name}
                for name in dict.fromkeys(name.lower() for name in headers)]
    return {"forward_rules": {"allowed_headers": {"patterns": patterns}}}







