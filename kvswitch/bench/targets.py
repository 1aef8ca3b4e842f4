"""Benchmark targets: what stands between the load generator and the engine pool.

- `kvswitch[:CONFIG]`: Envoy + the EPP with an EndpointPickerConfig (default
  `kvswitch/bench/configs/kvswitch.yaml`, `kvswitch up`'s default profile: estimated-ttft-scorer
  over the precise KV-event index; `kvswitch-approximate.yaml`, llm-d's approximate prefix 3 /
  queue 2 / KV utilisation 2, when the `precise-prefix-cache-scorer` plugin is not registered);
  `kvswitch-estimated-ttft` uses the estimated-ttft-scorer with its own defaults;
  `kvswitch-text` sends text prompts (the EPP tokenizes for routing, the engine for serving).
- `kvswitch@N` (any EPP target with `@N`): N EPPs behind the one Envoy, active-active.
- `round-robin`: Envoy alone, ROUND_ROBIN over the pool.
- `random`: Envoy + the EPP with only a `random-picker`.
- `smg-cache-aware`, `smg-round-robin`: SMG (PyPI `smg`) in front of the engines over gRPC;
  reported unavailable (with the reason) when it cannot run here.
- `oracle`: no gateway; the client routes each request itself (`kvswitch.bench.oracle`).
Every target gets the same engines, flushed cold before it runs.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from kvswitch.bench.client import RequestResult
from kvswitch.bench.contracts import RunContext, Target
from kvswitch.bench.oracle import OracleRouter
from kvswitch.bench.smg import SmgTarget
from kvswitch.bench.workloads import BenchRequest
from kvswitch.engine.sim.profiles import get_profile
from kvswitch.envoy import (
    EPP_HEADERS,
    GatewayOptions,
    PoolTarget,
    build_bootstrap,
    render,
    session_headers,
)
from kvswitch.epp.kvindex import KvBlockIndex, KvEventSubscriptions
from kvswitch.launcher import envoy_spec, epp_spec, free_port, write_pool_file
from kvswitch.supervisor import Child


def bundled_config(name: str) -> Path:
    return Path(str(resources.files("kvswitch.bench").joinpath(f"configs/{name}")))


@dataclass
class GatewayTarget:
    """Envoy on a fresh port, with the EPP (`epp_config`) or round robin (`epp_config` None)."""

    name: str
    epp_config: Path | None
    text_prompts: bool = False
    epp_replicas: int = 1
    """EPPs behind the Envoy, active-active (`kvswitch@N`)."""
    _children: list[Child] = field(default_factory=list)
    _address: str = ""

    async def start(self, ctx: RunContext) -> None:
        import asyncio

        await asyncio.to_thread(self._start_processes, ctx)

    def _start_processes(self, ctx: RunContext) -> None:
        label = safe_label(self.name)
        state = ctx.state_dir / label
        state.mkdir(parents=True, exist_ok=True)
        port, admin = free_port(), free_port()
        epps: tuple[str, ...] = ()
        epp_headers: tuple[str, ...] = EPP_HEADERS
        if self.epp_config is not None:
            pool = write_pool_file(state / "pool.yaml", ctx.pool.addresses, api=ctx.pool.api)
            config = state / "epp.yaml"
            shutil.copyfile(self.epp_config, config)
            ports = [free_port() for _ in range(self.epp_replicas)]
            epps = tuple(f"127.0.0.1:{p}" for p in ports)
            several = len(epps) > 1
            specs = [epp_spec(config, pool, port, free_port(), want_ready=len(ctx.pool.addresses),
                              name=f"epp-{label}" + (f"-{i}" if several else ""),
                              replica_name=epps[i] if several else "")
                     for i, port in enumerate(ports)]
            self._children += ctx.supervisor.start_all(specs, timeout=60.0)
            epp_headers = (*EPP_HEADERS, *session_headers(config))
        options = GatewayOptions(pool=PoolTarget(tuple(ctx.pool.addresses)), epps=epps,
                                 port=port, admin_port=admin,
                                 round_robin=self.epp_config is None, epp_headers=epp_headers)
        envoy_config = state / "envoy.yaml"
        envoy_config.write_text(render(build_bootstrap(options)))
        self._children.append(ctx.supervisor.start(
            envoy_spec(envoy_config, admin, name=f"envoy-{label}"), timeout=60.0))
        self._address = f"127.0.0.1:{port}"

    def choose(self, request: BenchRequest) -> tuple[str, str]:
        return self._address, ""

    def addresses(self) -> list[str]:
        return [self._address]

    def first_token(self, request: BenchRequest) -> None:
        pass

    def finished(self, request: BenchRequest, result: RequestResult) -> None:
        pass

    async def stop(self) -> None:
        import asyncio

        for child in reversed(self._children):
            await asyncio.to_thread(child.stop)
        self._children.clear()


@dataclass
class OracleTarget:
    name: str = "oracle"
    text_prompts: bool = False
    _router: OracleRouter | None = None
    _subscriptions: KvEventSubscriptions | None = None

    async def start(self, ctx: RunContext) -> None:
        import asyncio

        profile = get_profile(ctx.pool.profile)
        index = KvBlockIndex(profile.block_size)
        api = ctx.pool.api
        self._subscriptions = KvEventSubscriptions(index, api_of=lambda address: api)
        await self._subscriptions.set_endpoints(ctx.pool.addresses)
        scale = ctx.pool.time_scale
        self._router = OracleRouter(ctx.pool.addresses, profile, index,
                                    clock=lambda: time.monotonic() * scale)
        # Wait until every stream is open (the caches are cold: nothing to replay).
        for _ in range(200):
            if all(s.connected for s in self._subscriptions.subscribers.values()):
                break
            await asyncio.sleep(0.05)

    def choose(self, request: BenchRequest) -> tuple[str, str]:
        assert self._router is not None
        engine = self._router.choose(request)
        return engine, engine

    def addresses(self) -> list[str]:
        return list(self._router.engines) if self._router is not None else []

    def first_token(self, request: BenchRequest) -> None:
        assert self._router is not None
        self._router.first_token(request)

    def finished(self, request: BenchRequest, result: RequestResult) -> None:
        assert self._router is not None
        self._router.finished(request, result)

    async def stop(self) -> None:
        if self._subscriptions is not None:
            await self._subscriptions.stop()


TARGET_NAMES = ("kvswitch", "kvswitch-estimated-ttft", "kvswitch-approximate", "kvswitch-text",
                "round-robin", "random", "smg-cache-aware", "smg-round-robin", "oracle")


def safe_label(name: str) -> str:
    """`name` usable as a file name and a supervisor child name (a `kvswitch:/abs/path.yaml`
    target's slashes and colon would otherwise end up in log file paths)."""
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.") or "target"
    return label if len(label) <= 80 else f"{label[:20]}_{label[-59:]}"


def make_target(spec: str) -> Target:
    """A target from its name; `kvswitch:PATH` uses the EPP config at PATH (or, when PATH is
    not a file, the bundled `configs/PATH[.yaml]`); `@N` after an EPP target runs N EPPs behind
    its Envoy (`kvswitch@3`)."""
    base, at, count = spec.rpartition("@")
    if at and count.isdigit():
        target = make_target(base)
        if not isinstance(target, GatewayTarget) or target.epp_config is None:
            raise ValueError(f"{spec!r}: only an EPP target runs several EPPs")
        return dataclasses.replace(target, name=spec, epp_replicas=int(count))
    name, _, argument = spec.partition(":")
    if name in ("kvswitch", "kvswitch-text"):
        default = "kvswitch.yaml" if precise_plugin_available() else "kvswitch-approximate.yaml"
        config = config_path(argument) if argument else bundled_config(default)
        return GatewayTarget(spec, config, text_prompts=name == "kvswitch-text")
    if name in ("kvswitch-estimated-ttft", "kvswitch-approximate"):
        return GatewayTarget(spec, bundled_config(f"{name}.yaml"))
    if name == "round-robin":
        return GatewayTarget(spec, None)
    if name == "random":
        return GatewayTarget(spec, bundled_config("random.yaml"))
    if name == "oracle":
        return OracleTarget()
    if name in ("smg-cache-aware", "smg-round-robin"):
        return SmgTarget(spec, "cache_aware" if name == "smg-cache-aware" else "round_robin")
    raise ValueError(f"unknown target {spec!r}; known: {', '.join(TARGET_NAMES)}")


def config_path(argument: str) -> Path:
    """An EPP config file: `argument` itself when it is a file, else the bundled config of that
    name (`configs/NAME` or `configs/NAME.yaml`); ValueError when neither exists."""
    path = Path(argument).expanduser()
    if path.is_file():
        return path
    for candidate in (argument, f"{argument}.yaml"):
        bundled = bundled_config(candidate)
        if "/" not in argument and bundled.is_file():
            return bundled
    raise ValueError(f"EPP config {argument!r} not found (a file, or a bundled config name: "
                     f"kvswitch, kvswitch-estimated-ttft, kvswitch-approximate, random)")


def precise_plugin_available() -> bool:
    from kvswitch.epp.framework import known_types

    return "precise-prefix-cache-scorer" in known_types()
