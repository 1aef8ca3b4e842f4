"""Envoy for kvswitch: the bootstrap config, the `envoy-config` command, and the process."""

from __future__ import annotations

from kvswitch.envoy.bootstrap import GatewayOptions, PoolTarget, Routing, build_bootstrap
from kvswitch.envoy.cli import add_arguments, read_pool, render, run
from kvswitch.envoy.process import EnvoyProcess, envoy_binary, validate_config

__all__ = [
    "GatewayOptions",
    "PoolTarget",
    "Routing",
    "build_bootstrap",
    "add_arguments",
    "run",
    "read_pool",
    "render",
    "EnvoyProcess",
    "envoy_binary",
    "validate_config",
]
