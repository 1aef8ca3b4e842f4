"""Launch a gateway on loopback: engines, the EPP, Envoy and frontends as supervised processes.

`launch_gateway(supervisor, GatewaySpec(...), state_dir)` starts the engines and the EPP (in
parallel), then Envoy, then the frontends, each waited for until ready. Its building blocks
(`engine_spec`, `write_pool_file`, `epp_spec`, `envoy_spec`, `frontend_spec`) are what
`kvswitch up`, `kvswitch bench`, the benchmarks and the e2e tests start pools with, so all of
them start processes the same way. With `GatewaySpec.tls` every hop runs over TLS: the listener
(asking outside clients for a certificate only with `TlsDir.client_auth`), and mTLS from Envoy
to the EPPs, engines and frontends and from the EPPs to the engines; the frontends call the
listener over TLS, presenting client.crt.
"""

from __future__ import annotations

import importlib.util
import logging
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvswitch.envoy import (
    EPP_HEADERS,
    GatewayOptions,
    PoolTarget,
    build_bootstrap,
    render,
    session_headers,
)
from kvswitch.envoy.process import envoy_binary
from kvswitch.supervisor import ChildSpec, ReadyProbe, Supervisor, http_ok, port_open
from kvswitch.tls import UpstreamTls, client_ssl_context
from kvswitch.tls_dir import TlsDir

__all__ = [
    "DEFAULT_EPP_CONFIG",
    "GatewaySpec",
    "LaunchedGateway",
    "Ports",
    "engine_spec",
    "envoy_spec",
    "epp_spec",
    "free_port",
    "frontend_spec",
    "launch_gateway",
    "write_epp_config",
    "write_pool_file",
]

logger = logging.getLogger("kvswitch.up")

H2C = "kubernetes.io/h2c"
READY_ENDPOINTS_METRIC = "kvswitch_epp_pool_ready_endpoints"


# The estimated-TTFT profile: per replica, the prefill work ahead (the reported queue plus what
# the EPP sent and no report shows yet, or the prefill in progress from KV events) plus the
# request's own uncached prefill counted twice (a miss also spends prefill later requests of its
# prefix would get from the cache, and once more per request every replica has waiting) and 160
# prefill tokens per running request (its decode in every step ahead); a prefix under half the
# prompt is copied to replicas without it while some replica has no prefill ahead
# (cacheThreshold): to a second replica always, beyond two only while it is hot, each holder
# getting over 1/8 of a replica's fair share of requests from it alone (hotPrefixShare). The
# precise scorer is listed for its KV-event index. Chosen on the routing panel
# (docs/benchmarks/routing-panel/default.md); kvswitch/bench/configs/kvswitch.yaml and the Helm
# chart's files/default-plugins.yaml are the same profile (tests keep them equal).
DEFAULT_EPP_CONFIG = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"name": "vllmgrpc-parser", "type": "vllmgrpc-parser"},
        {"name": "sglanggrpc-parser", "type": "sglanggrpc-parser"},
        {"name": "openai-parser", "type": "openai-parser"},
        {"name": "precise-prefix-cache-scorer", "type": "precise-prefix-cache-scorer",
         "parameters": {"blockSize": 16}},
        {"name": "estimated-ttft-scorer", "type": "estimated-ttft-scorer",
         "parameters": {"uncachedWeight": 2, "runningRequestTokens": 160,
                        "saturationMissWeight": 1, "saturationQuantile": 0.75,
                        "cacheThreshold": 0.5, "hotPrefixShare": 0.125}},
        # The pick plus one fallback: Envoy retries a refused connection (a replica that died
        # before the EPP noticed) on the fallback instead of failing the request. A new prefix
        # goes, within 0.05 of the best score, to the replica that took the fewest blocks of new
        # prefixes lately (while some replica has nothing waiting): new groups spread evenly.
        {"name": "max-score-picker", "type": "max-score-picker",
         "parameters": {"maxNumOfEndpoints": 2, "newPrefixTolerance": 0.05}},
    ],
    "schedulingProfiles": [{"name": "default", "plugins": [
        {"pluginRef": "estimated-ttft-scorer", "weight": 1},
        {"pluginRef": "max-score-picker"},
    ]}],
    "requestHandler": {"parsers": [{"pluginRef": "vllmgrpc-parser"},
                                   {"pluginRef": "sglanggrpc-parser"},
                                   {"pluginRef": "openai-parser"}]},
}


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback TCP port free now that this process has not handed out before: the kernel
    may return the same free port to two binds in a row, and a port handed out is only bound
    later, by the child it is passed to."""
    import socket

    for _ in range(1_000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free loopback port that this process has not handed out already")


def kvswitch_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvswitch", *args]


def engine_spec(name: str, port: int, *, profile: str | None = None,
                time_scale: float | None = None, mode: str | None = None,
                grace_period: float = 5.0, extra: Sequence[str] = (),
                restart: bool = False) -> ChildSpec:
    argv = kvswitch_argv("engine", "--port", str(port), "--grace-period", f"{grace_period:g}")
    if profile:
        argv += ["--profile", profile]
    if time_scale is not None:
        argv += ["--time-scale", f"{time_scale:g}"]
    if mode:
        argv += ["--mode", mode]
    argv += list(extra)
    return ChildSpec(name, argv, ready=port_open(port), stop_timeout=grace_period + 5,
                     restart=restart)


def write_pool_file(path: Path, endpoints: Sequence[str], *, name: str = "kvswitch",
                    app_protocol: str = H2C, api: str = "vllm") -> Path:
    """An InferencePool plus the EndpointList naming its replicas (the EPP's pool file)."""
    from kvswitch.epp.config import static_pool

    docs = static_pool(list(endpoints), app_protocol=app_protocol, name=name, api=api)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def write_epp_config(path: Path, source: Path | None = None) -> Path:
    if source is not None:
        path.write_text(source.read_text())
    else:
        path.write_text(yaml.safe_dump(DEFAULT_EPP_CONFIG, sort_keys=False))
    return path


def epp_pool_ready(metrics_port: int, want: int) -> Callable[[], bool]:
    """Ready when the EPP's metrics say at least `want` endpoints are eligible for scheduling
    (before that, requests would get 503 "no ready endpoint")."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                text = response.read().decode()
        except (urllib.error.URLError, OSError):
            return False
        for line in text.splitlines():
            if line.startswith(READY_ENDPOINTS_METRIC + " "):
                return float(line.split()[1]) >= want
        return want == 0

    return probe


def epp_spec(config: Path, pool: Path, port: int, metrics_port: int,
             extra: Sequence[str] = (), *, want_ready: int = 0,
             restart: bool = False, name: str = "epp", replica_name: str = "") -> ChildSpec:
    """An EPP; ready once ext_proc listens and `want_ready` endpoints are schedulable.
    `replica_name`: its address as the Envoy bootstrap lists it, when several share Envoy."""
    argv = kvswitch_argv("epp", "--config", str(config), "--pool", str(pool),
                         "--port", str(port), "--metrics-port", str(metrics_port), *extra)
    if replica_name:
        argv += ["--replica-name", replica_name]
    listening, pool_ready = port_open(port), epp_pool_ready(metrics_port, want_ready)
    return ChildSpec(name, argv, ready=lambda: listening() and pool_ready(), stop_timeout=10.0,
                     restart=restart)


def epp_name(index: int, replicas: int) -> str:
    """The supervisor's name of EPP `index`: `epp` when it is the only one, else `epp-<index>`."""
    return "epp" if replicas == 1 else f"epp-{index}"


def envoy_spec(config: Path, admin_port: int, *, concurrency: int = 1,
               name: str = "envoy", restart: bool = False) -> ChildSpec:
    argv = [envoy_binary(), "-c", str(config), "--concurrency", str(concurrency),
            "--log-level", "warn", "--disable-hot-restart"]
    return ChildSpec(name, argv, ready=http_ok(f"http://127.0.0.1:{admin_port}/ready"),
                     stop_timeout=10.0, restart=restart)


def https_ok(port: int, path: str, tls: UpstreamTls) -> ReadyProbe:
    """Ready when GET `path` over TLS (as `tls` says: CA, client certificate, name) on
    127.0.0.1:`port` answers 200."""
    context = client_ssl_context(tls, alpn="http/1.1")
    request = f"GET {path} HTTP/1.1\r\nHost: {tls.sni}\r\nConnection: close\r\n\r\n"

    def probe() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as raw, \
                    context.wrap_socket(raw, server_hostname=tls.sni) as sock:
                sock.sendall(request.encode())
                return sock.recv(64).startswith((b"HTTP/1.1 200", b"HTTP/1.0 200"))
        except OSError:
            return False

    return probe


def frontend_spec(name: str, port: int, target: str, extra: Sequence[str] = (), *,
                  restart: bool = False, tls: TlsDir | None = None) -> ChildSpec:
    """A frontend; with `tls` it serves HTTPS (mTLS) and calls `target` over mTLS."""
    argv = kvswitch_argv("frontend", "--target", target, "--port", str(port), *extra)
    ready = http_ok(f"http://127.0.0.1:{port}/health")
    if tls is not None:
        argv += [*tls.server_flags(), *tls.client_flags("target")]
        ready = https_ok(port, "/health", tls.client())
    return ChildSpec(name, argv, ready=ready, stop_timeout=10.0, restart=restart)


def frontend_available() -> bool:
    return importlib.util.find_spec("kvswitch.frontend.cli") is not None


@dataclass(frozen=True, slots=True)
class Ports:
    public: int
    admin: int
    epps: tuple[int, ...]
    """ext_proc port of each EPP."""
    epp_metrics: tuple[int, ...]
    """Prometheus port of each EPP, in the same order."""
    engines: tuple[int, ...]
    frontends: tuple[int, ...]

    @classmethod
    def allocate(cls, public: int, admin: int | None, replicas: int, frontends: int,
                 epp_replicas: int = 1) -> Ports:
        return cls(public=public, admin=admin or free_port(),
                   epps=tuple(free_port() for _ in range(epp_replicas)),
                   epp_metrics=tuple(free_port() for _ in range(epp_replicas)),
                   engines=tuple(free_port() for _ in range(replicas)),
                   frontends=tuple(free_port() for _ in range(frontends)))


@dataclass(frozen=True)
class GatewaySpec:
    """What `launch_gateway` brings up."""

    port: int
    admin_port: int | None = None
    replicas: int = 4
    profile: str | None = None
    time_scale: float | None = None
    mode: str | None = None
    grace_period: float = 5.0
    engine_args: tuple[str, ...] = ()
    epp_config: Path | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None
    """A file, a config mapping (or several documents: the config plus InferenceObjectives),
    or None for `DEFAULT_EPP_CONFIG`."""
    epp_args: tuple[str, ...] = ()
    epp_replicas: int = 1
    extra_endpoints: tuple[str, ...] = ()
    """Pool members kvswitch does not start (tests: replicas that are down)."""
    frontend_workers: int = 0
    envoy_concurrency: int = 1
    routing: str = "override-host"
    restart_engines: bool = False
    restart_epp: bool = False
    restart_proxies: bool = False
    """Restart Envoy and the frontends when they exit (with backoff, as the others)."""
    api: str = "vllm"
    """The engines' gRPC API, "vllm" or "sglang"; the pool file and the frontends say so."""
    tls: TlsDir | None = None
    """Every hop over TLS with these files (see the module docstring); None: plaintext."""


@dataclass(frozen=True)
class LaunchedGateway:
    spec: GatewaySpec
    ports: Ports
    state_dir: Path
    endpoints: tuple[str, ...]
    """Every pool member, `ip:port`; the started engines first."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports.public}"

    def engine_name(self, address: str) -> str:
        return f"engine-{self.endpoints.index(address)}"


def launch_gateway(supervisor: Supervisor, spec: GatewaySpec, state_dir: Path,
                   stop_requested: Sequence[int] = ()) -> LaunchedGateway:
    """Start engines + EPP (in parallel), then Envoy, then frontends; each waited for."""
    if spec.epp_replicas < 1:
        raise ValueError("epp_replicas must be at least 1")
    ports = Ports.allocate(spec.port, spec.admin_port, spec.replicas, spec.frontend_workers,
                           spec.epp_replicas)
    endpoints = (*(f"127.0.0.1:{p}" for p in ports.engines), *spec.extra_endpoints)
    gateway = LaunchedGateway(spec, ports, state_dir, endpoints)
    pool = write_pool_file(state_dir / "pool.yaml", endpoints, api=spec.api)
    epp_config = state_dir / "epp.yaml"
    if isinstance(spec.epp_config, Path):
        write_epp_config(epp_config, spec.epp_config)
    else:
        source = spec.epp_config or DEFAULT_EPP_CONFIG
        docs = [source] if isinstance(source, Mapping) else list(source)
        epp_config.write_text(yaml.safe_dump_all([dict(d) for d in docs], sort_keys=False))
    tls = spec.tls
    engine_tls = tls.server_flags() if tls is not None else []
    epp_tls = [*tls.server_flags(), *tls.client_flags("engine")] if tls is not None else []
    engines = [engine_spec(f"engine-{i}", port, profile=spec.profile, time_scale=spec.time_scale,
                           mode=spec.mode, grace_period=spec.grace_period,
                           extra=("--api", spec.api, *engine_tls, *spec.engine_args),
                           restart=spec.restart_engines)
               for i, port in enumerate(ports.engines)]
    epp_addresses = tuple(f"127.0.0.1:{port}" for port in ports.epps)
    several = len(epp_addresses) > 1
    epps = [epp_spec(epp_config, pool, port, metrics, (*epp_tls, *spec.epp_args),
                     want_ready=len(engines),
                     restart=spec.restart_epp, name=epp_name(i, len(ports.epps)),
                     replica_name=epp_addresses[i] if several else "")
            for i, (port, metrics) in enumerate(zip(ports.epps, ports.epp_metrics))]
    logger.info("starting %d engines and %d EPPs (logs in %s)", len(engines), len(epps),
                state_dir)
    supervisor.start_all([*engines, *epps])
    if stop_requested:
        return gateway
    envoy_config = state_dir / "envoy.yaml"
    options = GatewayOptions(
        pool=PoolTarget(endpoints, H2C), epps=epp_addresses, port=ports.public,
        admin_port=ports.admin, frontends=tuple(f"127.0.0.1:{p}" for p in ports.frontends),
        routing=spec.routing,  # type: ignore[arg-type]
        epp_headers=(*EPP_HEADERS, *session_headers(epp_config)),
        tls=tls.listener() if tls is not None else None,
        epp_tls=tls.client() if tls is not None else None,
        engine_tls=tls.client() if tls is not None else None,
        frontend_tls=tls.client() if tls is not None else None,
    )
    envoy_config.write_text(render(build_bootstrap(options)))
    logger.info("starting Envoy on 127.0.0.1:%d", ports.public)
    supervisor.start(envoy_spec(envoy_config, ports.admin, concurrency=spec.envoy_concurrency,
                                restart=spec.restart_proxies))
    if ports.frontends and not stop_requested:
        supervisor.start_all([frontend_spec(f"frontend-{i}", port, gateway.address,
                                            ("--api", spec.api), restart=spec.restart_proxies,
                                            tls=tls)
                              for i, port in enumerate(ports.frontends)])
    return gateway
