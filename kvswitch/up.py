"""`kvswitch up`: the embedded default gateway on one machine.

Starts, all on 127.0.0.1: N simulated engines, the EPP, the OpenAI frontend(s) and Envoy on the
public `--port` (gRPC and HTTP on the same port), waits until each is ready, prints how to call
it, and supervises. Policy when a child exits on its own: an engine is restarted on the same port
(up to 5 times; the EPP routes around it meanwhile), and so is the EPP (responses in flight do
not depend on it once routed; new requests get UNAVAILABLE until it is back); Envoy or a
frontend exiting, or an engine or the EPP exiting a sixth time, stops everything and `up` exits
1. Ctrl-C / SIGTERM stops every child by PID (engines get SIGTERM and
their grace period) and exits 0.

`launch_gateway(supervisor, GatewaySpec(...), state_dir)` and its building blocks
(`engine_spec`, `write_pool_file`, `epp_spec`, `envoy_spec`, `frontend_spec`) are public so that
`kvswitch bench`, the benchmarks and the e2e tests start pools exactly the same way.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
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
from kvswitch.supervisor import ChildExited, ChildSpec, Supervisor, http_ok, port_open

__all__ = [
    "DEFAULT_EPP_CONFIG",
    "GatewaySpec",
    "LaunchedGateway",
    "Ports",
    "add_arguments",
    "engine_spec",
    "envoy_spec",
    "epp_spec",
    "free_port",
    "frontend_spec",
    "launch_gateway",
    "run",
    "write_epp_config",
    "write_pool_file",
]

logger = logging.getLogger("kvswitch.up")

H2C = "kubernetes.io/h2c"
READY_ENDPOINTS_METRIC = "kvswitch_epp_pool_ready_endpoints"

# The estimated-TTFT profile: per replica, the prefill work ahead (the reported queue plus what
# the EPP sent and no report shows yet, or the prefill in progress from KV events) plus the
# request's own uncached prefill counted twice (a miss also spends prefill later requests of its
# prefix would get from the cache) and 48 prefill tokens per running request (its decode in
# every step ahead); the precise scorer is listed for its KV-event index. Chosen on the routing
# panel (docs/benchmarks/routing-panel/default.md); kvswitch/bench/configs/kvswitch.yaml is the
# same profile (a test keeps them equal).
DEFAULT_EPP_CONFIG = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"name": "vllmgrpc-parser", "type": "vllmgrpc-parser"},
        {"name": "openai-parser", "type": "openai-parser"},
        {"name": "precise-prefix-cache-scorer", "type": "precise-prefix-cache-scorer",
         "parameters": {"blockSize": 16}},
        {"name": "estimated-ttft-scorer", "type": "estimated-ttft-scorer",
         "parameters": {"uncachedWeight": 2, "runningRequestTokens": 48}},
        # The pick plus one fallback: Envoy retries a refused connection (a replica that died
        # before the EPP noticed) on the fallback instead of failing the request.
        {"name": "max-score-picker", "type": "max-score-picker",
         "parameters": {"maxNumOfEndpoints": 2}},
    ],
    "schedulingProfiles": [{"name": "default", "plugins": [
        {"pluginRef": "estimated-ttft-scorer", "weight": 1},
        {"pluginRef": "max-score-picker"},
    ]}],
    "requestHandler": {"parsers": [{"pluginRef": "vllmgrpc-parser"},
                                   {"pluginRef": "openai-parser"}]},
}


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
                    app_protocol: str = H2C) -> Path:
    """An InferencePool plus the EndpointList naming its replicas (the EPP's pool file)."""
    from kvswitch.epp.config import static_pool

    docs = static_pool(list(endpoints), app_protocol=app_protocol, name=name)
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
             restart: bool = False) -> ChildSpec:
    """The EPP; ready once ext_proc listens and `want_ready` endpoints are schedulable."""
    argv = kvswitch_argv("epp", "--config", str(config), "--pool", str(pool),
                         "--port", str(port), "--metrics-port", str(metrics_port), *extra)
    listening, pool_ready = port_open(port), epp_pool_ready(metrics_port, want_ready)
    return ChildSpec("epp", argv, ready=lambda: listening() and pool_ready(), stop_timeout=10.0,
                     restart=restart)


def envoy_spec(config: Path, admin_port: int, *, concurrency: int = 1,
               name: str = "envoy") -> ChildSpec:
    argv = [envoy_binary(), "-c", str(config), "--concurrency", str(concurrency),
            "--log-level", "warn", "--disable-hot-restart"]
    return ChildSpec(name, argv, ready=http_ok(f"http://127.0.0.1:{admin_port}/ready"),
                     stop_timeout=10.0)


def frontend_spec(name: str, port: int, target: str, extra: Sequence[str] = ()) -> ChildSpec:
    argv = kvswitch_argv("frontend", "--target", target, "--port", str(port), *extra)
    return ChildSpec(name, argv, ready=http_ok(f"http://127.0.0.1:{port}/health"),
                     stop_timeout=10.0)


def frontend_available() -> bool:
    return importlib.util.find_spec("kvswitch.frontend.cli") is not None


@dataclass(frozen=True, slots=True)
class Ports:
    public: int
    admin: int
    epp: int
    epp_metrics: int
    engines: tuple[int, ...]
    frontends: tuple[int, ...]

    @classmethod
    def allocate(cls, public: int, admin: int | None, replicas: int, frontends: int) -> Ports:
        return cls(public=public, admin=admin or free_port(), epp=free_port(),
                   epp_metrics=free_port(),
                   engines=tuple(free_port() for _ in range(replicas)),
                   frontends=tuple(free_port() for _ in range(frontends)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Start the embedded default on loopback: N simulated vLLM engines (kvswitch engine),\n"
        "the endpoint picker (kvswitch epp), the OpenAI frontend (kvswitch frontend) and Envoy,\n"
        "all behind one port that answers both gRPC (vllm.grpc.engine.VllmEngine) and the\n"
        "OpenAI HTTP API. Prints how to call it; Ctrl-C or SIGTERM stops every process.")
    parser.epilog = (
        "examples:\n"
        "  kvswitch up                                  # 4 engines, port 8000\n"
        "  kvswitch up --replicas 8 --profile qwen3-32b-2xh100 --time-scale 10\n"
        "  kvswitch up --mode echo --epp-config my-epp.yaml --log-dir ./logs")
    parser.add_argument("--port", type=int, default=8000,
                        help="public port for gRPC and HTTP (default: %(default)s)")
    parser.add_argument("--admin-port", type=int, default=None,
                        help="Envoy admin port (default: a free port)")
    parser.add_argument("--replicas", type=int, default=4,
                        help="simulated engines (default: %(default)s)")
    parser.add_argument("--profile", default="llama3-8b-h100",
                        help="engine profile: llama3-8b-h100, qwen3-32b-2xh100 or tiny "
                             "(default: %(default)s)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="simulated seconds per real second (default: %(default)s)")
    parser.add_argument("--mode", choices=["echo", "random"], default="random",
                        help="echo returns the prompt's tokens; random draws seeded tokens "
                             "(default: %(default)s)")
    parser.add_argument("--grace-period", type=float, default=5.0,
                        help="seconds engines get to finish in-flight requests on shutdown "
                             "(default: %(default)s)")
    parser.add_argument("--epp-config", type=Path, default=None,
                        help="EndpointPickerConfig YAML (default: precise prefix-cache routing "
                             "weighed against load, see docs/configuration.md)")
    parser.add_argument("--no-frontend", action="store_true",
                        help="gRPC only, no OpenAI HTTP API")
    parser.add_argument("--frontend-workers", type=int, default=1,
                        help="frontend processes (default: %(default)s)")
    parser.add_argument("--envoy-concurrency", type=int, default=1,
                        help="Envoy worker threads (default: %(default)s)")
    parser.add_argument("--routing", choices=["override-host", "original-dst"],
                        default="override-host",
                        help="how Envoy honours the EPP's pick (default: %(default)s)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where configs and child logs go (default: a new temp dir)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [kvswitch up] %(message)s",
                        datefmt="%H:%M:%S")
    state_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvswitch-up-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    with_frontend = not args.no_frontend and frontend_available()
    if not args.no_frontend and not with_frontend:
        logger.warning("kvswitch.frontend is not installed: serving gRPC only")
    spec = GatewaySpec(
        port=args.port, admin_port=args.admin_port, replicas=args.replicas,
        profile=args.profile, time_scale=args.time_scale, mode=args.mode,
        grace_period=args.grace_period, epp_config=args.epp_config,
        frontend_workers=args.frontend_workers if with_frontend else 0,
        envoy_concurrency=args.envoy_concurrency, routing=args.routing, restart_engines=True,
        restart_epp=True,
    )
    stop_requested: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_requested.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    supervisor = Supervisor(state_dir)
    try:
        gateway = launch_gateway(supervisor, spec, state_dir, stop_requested)
        if stop_requested:
            return 0
        print(usage(gateway.ports, with_frontend, state_dir), flush=True)
        return _supervise(supervisor, stop_requested)
    except (RuntimeError, TimeoutError) as exc:
        logger.error("%s", exc)
        return 1
    finally:
        logger.info("stopping %d processes", len(supervisor.children))
        supervisor.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
    extra_endpoints: tuple[str, ...] = ()
    """Pool members kvswitch does not start (tests: replicas that are down)."""
    frontend_workers: int = 0
    envoy_concurrency: int = 1
    routing: str = "override-host"
    restart_engines: bool = False
    restart_epp: bool = False


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
    ports = Ports.allocate(spec.port, spec.admin_port, spec.replicas, spec.frontend_workers)
    endpoints = (*(f"127.0.0.1:{p}" for p in ports.engines), *spec.extra_endpoints)
    gateway = LaunchedGateway(spec, ports, state_dir, endpoints)
    pool = write_pool_file(state_dir / "pool.yaml", endpoints)
    epp_config = state_dir / "epp.yaml"
    if isinstance(spec.epp_config, Path):
        write_epp_config(epp_config, spec.epp_config)
    else:
        source = spec.epp_config or DEFAULT_EPP_CONFIG
        docs = [source] if isinstance(source, Mapping) else list(source)
        epp_config.write_text(yaml.safe_dump_all([dict(d) for d in docs], sort_keys=False))
    engines = [engine_spec(f"engine-{i}", port, profile=spec.profile, time_scale=spec.time_scale,
                           mode=spec.mode, grace_period=spec.grace_period,
                           extra=spec.engine_args, restart=spec.restart_engines)
               for i, port in enumerate(ports.engines)]
    logger.info("starting %d engines and the EPP (logs in %s)", len(engines), state_dir)
    supervisor.start_all([*engines, epp_spec(epp_config, pool, ports.epp, ports.epp_metrics,
                                             spec.epp_args, want_ready=len(engines),
                                             restart=spec.restart_epp)])
    if stop_requested:
        return gateway
    envoy_config = state_dir / "envoy.yaml"
    options = GatewayOptions(
        pool=PoolTarget(endpoints, H2C), epp=f"127.0.0.1:{ports.epp}", port=ports.public,
        admin_port=ports.admin, frontends=tuple(f"127.0.0.1:{p}" for p in ports.frontends),
        routing=spec.routing,  # type: ignore[arg-type]
        epp_headers=(*EPP_HEADERS, *session_headers(epp_config)),
    )
    envoy_config.write_text(render(build_bootstrap(options)))
    logger.info("starting Envoy on 127.0.0.1:%d", ports.public)
    supervisor.start(envoy_spec(envoy_config, ports.admin, concurrency=spec.envoy_concurrency))
    if ports.frontends and not stop_requested:
        supervisor.start_all([frontend_spec(f"frontend-{i}", port, gateway.address)
                              for i, port in enumerate(ports.frontends)])
    return gateway


def _supervise(supervisor: Supervisor, stop_requested: list[int]) -> int:
    while not stop_requested:
        events: list[ChildExited] = supervisor.poll()
        for event in events:
            if event.restarted_pid is not None:
                continue
            if not event.name.startswith("engine-"):
                logger.error("%s exited: shutting everything down", event.name)
                return 1
            logger.error("%s keeps exiting: no more restarts, the pool is one replica smaller",
                         event.name)
        time.sleep(0.2)
    logger.info("received signal %d", stop_requested[0])
    return 0


def served_model(address: str) -> str:
    """The first model id the frontend lists (what the printed curl line must name)."""
    try:
        with urllib.request.urlopen(f"http://{address}/v1/models", timeout=5.0) as response:
            return str(json.loads(response.read())["data"][0]["id"])
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError):
        return "default"


def usage(ports: Ports, with_frontend: bool, state_dir: Path) -> str:
    address = f"127.0.0.1:{ports.public}"
    proto_dir = Path(importlib.util.find_spec("smg_grpc_proto").origin or "").parent / "proto"  # type: ignore[union-attr]
    lines = [
        "",
        (f"kvswitch is up on {address}  (Envoy admin 127.0.0.1:{ports.admin}, "
         f"EPP metrics http://127.0.0.1:{ports.epp_metrics}/metrics, logs {state_dir})"),
        "",
        "gRPC (grpcurl):",
        (f"  grpcurl -plaintext -import-path {proto_dir} -proto vllm_engine.proto "
         "-H 'x-llm-d-inference-fairness-id: tenant-a' "
         "-d '{\"request_id\": \"req-1\", \"text\": \"Hello\", "
         "\"sampling_params\": {\"max_tokens\": 10}, \"stream\": true}' "
         f"{address} vllm.grpc.engine.VllmEngine/Generate"),
        "",
        "gRPC (Python):",
        f"  {sys.executable} - <<'EOF'",
        "import grpc",
        "from kvswitch.protocol import vllm_engine_pb2 as pb, vllm_engine_pb2_grpc as rpc",
        f"stub = rpc.VllmEngineStub(grpc.insecure_channel('{address}'))",
        "request = pb.GenerateRequest(request_id='req-2', text='Hello', stream=True,",
        "                             sampling_params=pb.SamplingParams(max_tokens=10))",
        ("for response in stub.Generate(request, metadata=[('x-llm-d-inference-fairness-id', "
         "'tenant-a')]):"),
        "    print(response)",
        "EOF",
    ]
    if with_frontend:
        body = json.dumps({"model": served_model(address), "max_tokens": 10,
                           "messages": [{"role": "user", "content": "Hello"}]})
        lines += [
            "",
            "OpenAI HTTP:",
            (f"  curl -s http://{address}/v1/chat/completions -H 'content-type: application/json' "
             f"-d '{body}'"),
        ]
    lines += ["", "Ctrl-C stops everything.", ""]
    return "\n".join(lines)
