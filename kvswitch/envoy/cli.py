"""`kvswitch envoy-config`: write the Envoy bootstrap for a pool and an EPP."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from kvswitch.envoy.bootstrap import EPP_HEADERS, GatewayOptions, build_bootstrap
from kvswitch.envoy.clusters import H2C, PoolTarget
from kvswitch.tls import (
    add_tls_flags,
    add_upstream_tls_flags,
    tls_from_args,
    upstream_tls_from_args,
)

__all__ = ["add_arguments", "read_pool", "render", "run", "session_headers"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool", help="InferencePool YAML listing the endpoints (or "
                        "--pool-service)")
    parser.add_argument("--pool-service", metavar="NAME:PORT",
                        help="instead of --pool: a DNS name resolving to every ready replica "
                             "(a headless Service), re-resolved every second")
    parser.add_argument("--app-protocol", choices=["kubernetes.io/h2c", "http"],
                        default="kubernetes.io/h2c", help="the pool's appProtocol with "
                        "--pool-service")
    parser.add_argument("--epp-failure-mode", choices=["FailClose", "FailOpen"],
                        default="FailClose", help="when the EPP cannot answer: 503 "
                        "(FailClose) or route by the pool cluster's round robin (FailOpen)")
    parser.add_argument("--epp", action="append", default=None, metavar="HOST:PORT",
                        help="EPP ext_proc address (default 127.0.0.1:9002); repeat for several "
                             "EPPs active-active, each run with --replica-name set to its "
                             "address as written here")
    parser.add_argument("--port", type=int, default=8000, help="public listener port")
    parser.add_argument("--host", default="127.0.0.1", help="public listener address")
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--frontend", action="append", default=[], metavar="HOST:PORT",
                        help="OpenAI frontend served on /v1/* and /health (repeatable)")
    parser.add_argument("--round-robin", action="store_true",
                        help="no EPP: plain round robin over the pool (benchmark baseline)")
    parser.add_argument("--routing", choices=["original-dst", "override-host"],
                        default="override-host", help="how the pool cluster honours the pick")
    parser.add_argument("--message-timeout", type=float, default=40.0,
                        help="seconds ext_proc waits for each EPP reply")
    parser.add_argument("--access-log", action="store_true", help="access log to stdout")
    parser.add_argument("--epp-header", action="append", default=[], metavar="NAME",
                        help="also send this request header to the EPP (repeatable; a trailing "
                             "* matches a prefix), e.g. a session-affinity-scorer's headerName. "
                             f"Sent by default: {', '.join(EPP_HEADERS)}")
    parser.add_argument("--epp-config", metavar="EPP_YAML",
                        help="the EPP's EndpointPickerConfig: its session-affinity-scorers' "
                             "headerName headers are sent to the EPP too")
    parser.add_argument("--epp-all-headers", action="store_true",
                        help="send the EPP every request header (plugins of your own that read "
                             "headers kvswitch does not know)")
    parser.add_argument("--report-served-endpoint", action="store_true",
                        help="add x-gateway-destination-endpoint-served (the replica's ip:port) "
                             "to every pool response")
    parser.add_argument("-o", "--output", help="file to write (.yaml or .json); default stdout")
    add_tls_flags(parser)
    add_upstream_tls_flags(parser, "epp", "EPP")
    add_upstream_tls_flags(parser, "engine", "engines")
    add_upstream_tls_flags(parser, "frontend", "frontends")


def run(args: argparse.Namespace) -> int:
    if (args.pool is None) == (args.pool_service is None):
        raise SystemExit("envoy-config: give exactly one of --pool and --pool-service")
    pool = (read_pool(args.pool) if args.pool is not None
            else PoolTarget((), app_protocol=args.app_protocol, service=args.pool_service))
    options = GatewayOptions(
        pool=pool, epps=tuple(args.epp or ("127.0.0.1:9002",)),
        epp_failure_mode=args.epp_failure_mode,
        report_served_endpoint=args.report_served_endpoint, port=args.port, host=args.host,
        admin_port=args.admin_port, frontends=tuple(args.frontend),
        round_robin=args.round_robin, routing=args.routing,
        message_timeout_s=args.message_timeout, access_log=args.access_log,
        epp_headers=None if args.epp_all_headers else (
            *EPP_HEADERS, *args.epp_header,
            *(session_headers(Path(args.epp_config)) if args.epp_config else ())),
        tls=tls_from_args(args),
        epp_tls=upstream_tls_from_args(args, "epp"),
        engine_tls=upstream_tls_from_args(args, "engine"),
        frontend_tls=upstream_tls_from_args(args, "frontend"),
    )
    text = render(build_bootstrap(options), json_format=bool(args.output and
                                                             args.output.endswith(".json")))
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def render(bootstrap: dict[str, Any], *, json_format: bool = False) -> str:
    if json_format:
        return json.dumps(bootstrap, indent=2) + "\n"
    return str(yaml.safe_dump(bootstrap, sort_keys=False))


def read_pool(path: str | Path) -> PoolTarget:
    """The endpoints and appProtocol of a pool file.

    The file holds an InferencePool (targetPorts, appProtocol) and the endpoints, in an
    `EndpointList` document (kvswitch.dev/v1alpha1, `endpoints:`) or under the pool's
    `spec.endpoints`. Entries are `ip:port`, `{address: ip:port}`, `{ip, port}` or a bare `ip`
    (one endpoint per target port).
    """
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if isinstance(d, dict)]
    if not docs:
        raise ValueError(f"{path}: no pool document")
    pool = next((d for d in docs if d.get("kind") == "InferencePool"), docs[0])
    spec = pool.get("spec") or {}
    target_ports = spec.get("targetPorts") or [{}]
    ports = [p.get("number") for p in target_ports if p.get("number") is not None]
    app_protocol = str(target_ports[0].get("appProtocol") or spec.get("appProtocol") or "http")
    listed = next((d for d in docs if d.get("kind") == "EndpointList"), None)
    raw = (listed or {}).get("endpoints") or spec.get("endpoints") or pool.get("endpoints") or []
    endpoints = tuple(a for entry in raw for a in _addresses(entry, ports))
    if not endpoints:
        raise ValueError(f"{path}: the pool lists no endpoints")
    return PoolTarget(endpoints=endpoints, app_protocol=H2C if app_protocol == H2C else "http")


def session_headers(epp_config: Path) -> tuple[str, ...]:
    """The `headerName`s of the config's session-affinity scorers: Envoy must send the EPP
    those request headers too (`EPP_HEADERS` has only the default one)."""
    names = []
    for doc in yaml.safe_load_all(epp_config.read_text()):
        plugins = doc.get("plugins") if isinstance(doc, dict) else None
        for plugin in plugins if isinstance(plugins, list) else ():
            if isinstance(plugin, dict) and plugin.get("type") == "session-affinity-scorer":
                name = (plugin.get("parameters") or {}).get("headerName")
                if isinstance(name, str):
                    names.append(name)
    return tuple(names)


def _addresses(entry: Any, ports: list[int]) -> list[str]:
    if isinstance(entry, dict):
        if ":" in str(entry.get("address", "")):
            return [str(entry["address"])]
        ip = entry.get("ip") or entry.get("address") or entry.get("host")
        if "port" in entry:
            return [f"{ip}:{entry['port']}"]
        entry = ip
    text = str(entry)
    if text.count(":") == 1 or text.startswith("["):
        return [text]
    return [f"{text}:{port}" for port in ports]
