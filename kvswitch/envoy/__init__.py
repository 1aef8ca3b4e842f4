"""Envoy for kvswitch: the bootstrap config, the `envoy-config` command, and the process."""

from __future__ import annotations

from kvswitch.envoy.bootstrap import (
    EPP_HEADERS,
    GatewayOptions,
    PoolTarget,
    Routing,
    build_bootstrap,
)
from kvswitch.envoy.cli import add_arguments, read_pool, render, run, session_headers
from kvswitch.envoy.process import EnvoyProcess, envoy_binary, validate_config

__all__ = [
    "EPP_HEADERS",
    "EnvoyProcess",
    "GatewayOptions",
    "PoolTarget",
    "Routing",
    "add_arguments",
    "build_bootstrap",
    "envoy_binary",
    "read_pool",
    "render",
    "run",
    "session_headers",
    "validate_config",
]
