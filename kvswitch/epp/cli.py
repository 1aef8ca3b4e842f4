"""`kvswitch epp`: run the endpoint picker, an Envoy ext_proc server, with Prometheus metrics.

    kvswitch epp --config epp.yaml --pool pool.yaml --port 9002 --metrics-port 9090

Envoy must call it with ext_proc processing_mode request_header SEND, request_body
FULL_DUPLEX_STREAMED (or BUFFERED), response_body NONE, and route on the
`x-gateway-destination-endpoint` header (`kvswitch envoy-config` writes such a bootstrap). How a
request ended comes from the response headers and trailers (SEND), or, as kvswitch's bootstrap
does it, from Envoy's gRPC access log streamed to this same port (for requests whose forwarded
`kvswitch` filter metadata says `access_logged: true`; kvswitch.epp.access_log).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
from collections.abc import Sequence
from typing import Any

from kvswitch.cli import DefaultsHelpFormatter
from kvswitch.epp.contracts import EndpointPicker

__all__ = ["add_arguments", "run"]

logger = logging.getLogger("kvswitch.epp")


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
                             "(vllmgrpc + openai parsers, prefix/queue/kv-cache scorers)")
    parser.add_argument("--pool", metavar="POOL_YAML", required=True,
                        help="InferencePool YAML with the EndpointList of model servers")
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


def build_picker(args: argparse.Namespace) -> EndpointPicker:
    from kvswitch.epp.config import build_endpoint_picker

    config: Any = args.config
    if args.refresh_interval is not None:
        config = _with_refresh_interval(args.config, args.refresh_interval)
    picker = build_endpoint_picker(config, args.pool)
    return dataclasses.replace(picker, max_body_bytes=args.max_body_bytes)


async def serve(picker: EndpointPicker, args: argparse.Namespace) -> None:
    from kvswitch.epp.server import EppServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = EppServer(picker, host=args.host, port=args.port, transport=args.transport)
    await server.start()
    logger.info("parsers: %s; max body %d bytes", ", ".join(p.name for p in picker.parsers),
                picker.max_body_bytes)
    try:
        await stop.wait()
        logger.info("stopping (grace %.1fs)", args.grace)
    finally:
        await server.stop(args.grace)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("grpc", "asyncio"):  # their debug output drowns the per-request lines
        logging.getLogger(noisy).setLevel(logging.INFO)
    try:
        picker = build_picker(args)
    except Exception as exc:  # noqa: BLE001 - config errors name the field; no traceback
        logger.error("cannot build the endpoint picker: %s", exc)
        return 2
    if args.metrics_port:
        import prometheus_client

        prometheus_client.start_http_server(args.metrics_port, addr=args.host)
        logger.info("metrics on http://%s:%d/metrics", args.host, args.metrics_port)
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
