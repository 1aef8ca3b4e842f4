"""`kvswitch epp`: run the endpoint picker, an Envoy ext_proc server, with Prometheus metrics.

    kvswitch epp --config epp.yaml --pool pool.yaml --port 9002 --metrics-port 9090
    kvswitch epp --pool-name qwen3 [--pool-namespace NS] [--kubeconfig FILE]   # in Kubernetes

Envoy must call it with ext_proc processing_mode request_header SEND, request_body
FULL_DUPLEX_STREAMED (or BUFFERED), response_body NONE, and route on the
`x-gateway-destination-endpoint` header (`kvswitch envoy-config` writes such a bootstrap). How a
request ended comes from the response headers and trailers (SEND), or, as kvswitch's bootstrap
does it, from Envoy's gRPC access log streamed to this same port (for requests whose forwarded
`kvswitch` filter metadata says `access_logged: true`; kvswitch.epp.access_log).
`--tls-cert` serves ext_proc over TLS (`--tls-self-signed`: with a certificate made at start,
which gateways that call the EPP without verifying it accept); `--engine-tls-ca` calls the
engines (load polls, KV events) over TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvswitch.cli import DefaultsHelpFormatter
from kvswitch.epp.contracts import EndpointPicker
from kvswitch.limits import add_sampling_flags, sampling_from_args
from kvswitch.tls import (
    TlsFiles,
    add_tls_flags,
    add_upstream_tls_flags,
    tls_from_args,
    upstream_tls_from_args,
)

__all__ = ["add_arguments", "run"]

logger = logging.getLogger("kvswitch.epp")

SELF_SIGNED_DAYS = 3650
"""`--tls-self-signed`'s certificate outlives the pod: nobody verifies it, so nothing renews it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsHelpFormatter
    parser.description = (
        "Run the endpoint picker (EPP): an Envoy ext_proc server that parses each request "
        "(vLLM gRPC or OpenAI JSON), picks a model-server replica and tells Envoy where to send "
        "it with the x-gateway-destination-endpoint header and envoy.lb metadata. The same "
        "port takes Envoy's gRPC access log (StreamAccessLogs), which tells it how the requests "
        "it routed ended."
    )
    parser.add_argument("--config", metavar="EPP_YAML",
                        help="EndpointPickerConfig YAML (llm-d.ai/v1alpha1); omitted: defaults "
                             "(vllmgrpc + sglanggrpc + openai parsers, prefix/queue/kv-cache "
                             "scorers)")
    parser.add_argument("--pool", metavar="POOL_YAML",
                        help="InferencePool YAML with the EndpointList of model servers (file "
                             "discovery; annotation kvswitch.dev/engine-api: sglang for an SGLang "
                             "gRPC pool); or --pool-name")
    parser.add_argument("--pool-name", metavar="NAME",
                        help="watch this InferencePool and its pods through the Kubernetes API "
                             "instead of a pool file")
    parser.add_argument("--pool-namespace", metavar="NS",
                        help="the InferencePool's namespace (default: $POD_NAMESPACE, else the "
                             "service account's, else default)")
    parser.add_argument("--kubeconfig", metavar="FILE",
                        help="kubeconfig for --pool-name (default: in-cluster, else ~/.kube)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve ext_proc on")
    parser.add_argument("--port", type=int, default=9002, help="ext_proc (gRPC) port")
    parser.add_argument("--metrics-port", type=int, default=9090,
                        help="Prometheus /metrics port (0: no metrics server)")
    parser.add_argument("--refresh-interval", metavar="DURATION",
                        help="endpoint refresh period, e.g. 50ms (overrides the config's "
                             "dataLayer.refreshInterval)")
    parser.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                        help="largest request body accepted (larger: 413 / RESOURCE_EXHAUSTED)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds in-flight streams get to finish on SIGTERM/SIGINT")
    parser.add_argument("--transport", choices=["h2", "grpcio"], default="h2",
                        help="ext_proc server: h2 = kvswitch's lean HTTP/2 gRPC server (Process "
                             "and grpc.health.v1 Health Check/Watch; several times less CPU per "
                             "request); grpcio = grpc.aio (adds server reflection)")
    add_sampling_flags(parser)
    parser.add_argument("--replica-name", default="", metavar="HOST:PORT",
                        help="with several EPPs behind one kvswitch Envoy: this EPP's ext_proc "
                             "address as the Envoy bootstrap lists it; the EPP signs the requests "
                             "it routes with it, so the gateway's access log sends it the entries "
                             "of its own requests (kvswitch up sets it)")
    add_tls_flags(parser)
    parser.add_argument("--tls-self-signed", action="store_true",
                        help="serve ext_proc over TLS with a certificate made at start (in a "
                             "temporary directory, removed on exit), for gateways that call the "
                             "EPP over TLS without verifying it (a GAIE gateway's default)")
    add_upstream_tls_flags(parser, "engine", "engines")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"],
                        help="debug logs one line per request")


def _with_refresh_interval(config: str | None, interval: str) -> list[dict[str, Any]]:
    from kvswitch.epp.config import load_documents

    docs: list[dict[str, Any]] = (
        [dict(d) for d in load_documents(config, "config")] if config else []
    )
    for doc in docs:
        if doc.get("kind") == "EndpointPickerConfig":
            break
    else:
        doc = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig"}
        docs.append(doc)
    doc["dataLayer"] = {**dict(doc.get("dataLayer") or {}), "refreshInterval": interval}
    return docs


def _kubernetes_discovery(args: argparse.Namespace) -> Any:
    if args.pool_name is None:
        return None
    from kvswitch.epp.datalayer.kube_discovery import (
        KubernetesDiscovery,
        api_client,
        default_namespace,
    )

    return KubernetesDiscovery(args.pool_name, args.pool_namespace or default_namespace(),
                               lambda: api_client(args.kubeconfig))


def _register_upstream_names(picker: EndpointPicker, pool_name: str) -> None:
    """Serve the router's metrics under llm-d's `llm_d_epp_*` names as well."""
    import prometheus_client

    from kvswitch.epp.router import EppRouter
    from kvswitch.epp.upstream_metrics import UpstreamNames

    router = picker.router
    if isinstance(router, EppRouter) and router.metrics.registry is prometheus_client.REGISTRY:
        UpstreamNames(router.metrics, router.datalayer, lambda: router.objectives,
                      pool_name).register(prometheus_client.REGISTRY)


def build_picker(args: argparse.Namespace) -> EndpointPicker:
    from kvswitch.epp.config import build_endpoint_picker

    config: Any = args.config
    if args.refresh_interval is not None:
        config = _with_refresh_interval(args.config, args.refresh_interval)
    if (args.pool is None) == (args.pool_name is None):
        raise ValueError("give exactly one of --pool (a pool file) and --pool-name (Kubernetes)")
    picker = build_endpoint_picker(config, args.pool, discovery=_kubernetes_discovery(args),
                                   engine_tls=upstream_tls_from_args(args, "engine"))
    return dataclasses.replace(picker, max_body_bytes=args.max_body_bytes,
                               sampling_limits=sampling_from_args(args),
                               replica_name=args.replica_name)


def serving_tls(args: argparse.Namespace, directory: Path) -> TlsFiles | None:
    """What ext_proc serves: the `--tls-*` files, or with `--tls-self-signed` a certificate
    written into `directory` now (no client certificate asked for)."""
    if not args.tls_self_signed:
        return tls_from_args(args)
    from kvswitch.tls_dir import write_self_signed

    files = write_self_signed(directory, valid_days=SELF_SIGNED_DAYS)
    return TlsFiles(files.path / "server.crt", files.path / "server.key", None,
                    args.tls_handshake_timeout)


async def serve(picker: EndpointPicker, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="kvswitch-epp-tls-") as directory:
        await _serve(picker, args, serving_tls(args, Path(directory)))


async def _serve(picker: EndpointPicker, args: argparse.Namespace,
                 tls: TlsFiles | None) -> None:
    from kvswitch.epp.server import EppServer
    from kvswitch.epp.serving import READINESS, SERVING

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = EppServer(picker, host=args.host, port=args.port, transport=args.transport,
                       tls=tls)
    metrics = None
    if args.metrics_port:
        # prometheus_client's own server spends a thread per connection with no head deadline,
        # so slow clients could pile threads up: serve on this loop instead.
        import prometheus_client

        from kvswitch.metrics_http import MetricsHttpServer

        # /health: the loop answers (liveness); /ready: the gRPC readiness service's status,
        # for probes that cannot reach the ext_proc port (TLS).
        metrics = MetricsHttpServer(
            lambda: prometheus_client.generate_latest(), lambda: True,
            is_ready=lambda: server.health_status(READINESS) == SERVING)
        await metrics.start(args.host, args.metrics_port)
        logger.info("metrics on http://%s:%d/metrics", args.host, args.metrics_port)
    await server.start()
    logger.info("parsers: %s; max body %d bytes", ", ".join(p.name for p in picker.parsers),
                picker.max_body_bytes)
    try:
        await stop.wait()
        logger.info("stopping (grace %.1fs)", args.grace)
    finally:
        await server.stop(args.grace)
        if metrics is not None:
            await metrics.stop()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("grpc", "asyncio"):  # their debug output drowns the per-request lines
        logging.getLogger(noisy).setLevel(logging.INFO)
    try:
        if args.tls_self_signed and tls_from_args(args) is not None:
            raise ValueError("--tls-self-signed excludes --tls-cert, --tls-key and --tls-client-ca")
        picker = build_picker(args)
    except Exception as exc:  # noqa: BLE001 - config errors name the field; no traceback
        logger.error("cannot build the endpoint picker: %s", exc)
        return 2
    if args.metrics_port:
        _register_upstream_names(picker, args.pool_name or "")
    try:
        import uvloop

        uvloop.run(serve(picker, args))
    except OSError as exc:
        logger.error("endpoint picker failed: %s", exc)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvswitch epp")
    add_arguments(parser)
    return run(parser.parse_args(argv))
