"""`kvswitch up`: the embedded default gateway on one machine.

Starts, all on 127.0.0.1: N simulated engines, the EPP, the OpenAI frontend(s) and Envoy on the
public `--port` (gRPC and HTTP on the same port), waits until each is ready, prints how to call
it, and supervises. Policy when a child exits on its own: it is restarted with the same argv
and port, with backoff (0.5 s, doubling per restart in a row, up to 5 in a row; the log says
each exit and restart): an engine (the EPP routes around it meanwhile), the EPP (responses in
flight do not depend on it once routed; new requests get UNAVAILABLE until it is back), Envoy
and the frontends (their clients' calls fail and are retried by the clients). One that keeps
exiting stops everything and `up` exits 1, except an engine: the pool is then one replica
smaller. Ctrl-C / SIGTERM stops every child by PID (engines get SIGTERM and their grace period)
and exits 0.

The processes are started by `kvswitch.launcher.launch_gateway`, as `kvswitch bench`, the
benchmarks and the e2e tests start them.

TLS: `--tls-dir DIR` (ca.crt, server.crt/key, client.crt/key; the server certificate names
`--tls-server-name`, default `localhost`) or `--tls-self-signed` (a fresh CA and certificates
for that name in a temporary directory, removed on exit) puts every hop on TLS
(`kvswitch.launcher`). The listener serves TLS, and with `--tls-client-auth` requires a client
certificate signed by ca.crt. The printed lines connect to 127.0.0.1, verify the listener
against ca.crt as the server name (which they send as SNI) and, with `--tls-client-auth`,
present client.crt.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import logging
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from kvswitch.engine.sim.profiles import PROFILES
from kvswitch.launcher import GatewaySpec, Ports, frontend_available, launch_gateway
from kvswitch.supervisor import ChildExited, Supervisor
from kvswitch.tls import HANDSHAKE_TIMEOUT
from kvswitch.tls_dir import FILES, SNI, TlsDir, check_server_name, write_self_signed

__all__ = ["add_arguments", "run"]

logger = logging.getLogger("kvswitch.up")


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
        "  kvswitch up --mode echo --epp-config my-epp.yaml --log-dir ./logs\n"
        "  kvswitch up --tls-self-signed                # every hop on TLS\n"
        "  kvswitch up --tls-self-signed --tls-client-auth --tls-server-name gateway.test")
    parser.add_argument("--port", type=int, default=8000,
                        help="public port for gRPC and HTTP (default: %(default)s)")
    parser.add_argument("--admin-port", type=int, default=None,
                        help="Envoy admin port (default: a free port)")
    parser.add_argument("--replicas", type=int, default=4,
                        help="simulated engines (default: %(default)s)")
    parser.add_argument("--profile", default="llama3-8b-h100", choices=sorted(PROFILES),
                        help="engine profile: a model on GPUs, its step times and KV capacity "
                             "(docs/simulator.md; default: %(default)s)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="simulated seconds per real second (default: %(default)s)")
    parser.add_argument("--mode", choices=["echo", "random"], default="random",
                        help="echo returns the prompt's tokens; random draws seeded tokens "
                             "(default: %(default)s)")
    parser.add_argument("--api", choices=["vllm", "sglang"], default="vllm",
                        help="the engines' gRPC API: vllm.grpc.engine.VllmEngine or "
                             "sglang.grpc.scheduler.SglangScheduler (docs/sglang.md) "
                             "(default: %(default)s)")
    parser.add_argument("--page-size", type=int, default=None,
                        help="--api sglang: the engines' radix-cache page size in tokens "
                             "(default: the engine's, 1)")
    parser.add_argument("--grace-period", type=float, default=5.0,
                        help="seconds engines get to finish in-flight requests on shutdown "
                             "(default: %(default)s)")
    parser.add_argument("--epp-config", type=Path, default=None,
                        help="EndpointPickerConfig YAML (default: precise prefix-cache routing "
                             "weighed against load, see docs/configuration.md)")
    parser.add_argument("--epp-replicas", type=int, default=1,
                        help="endpoint pickers behind Envoy, active-active: any of them routes "
                             "any request, and Envoy moves new requests off one that died "
                             "(default: %(default)s)")
    parser.add_argument("--load-push-ms", type=float, default=None, metavar="MS",
                        help="with several EPPs, each engine sends them its load MS ms after "
                             "a request arrives (kvswitch engine --load-push-ms; default: the "
                             "engine's, 1; 0: never)")
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
    tls = parser.add_argument_group("TLS on every hop (default: plaintext)")
    source = tls.add_mutually_exclusive_group()
    source.add_argument("--tls-dir", type=Path, default=None, metavar="DIR",
                        help=f"PEM files {', '.join(FILES)}: the listener serves server.crt, "
                             "and every internal hop is mTLS with client.crt; server.crt must "
                             "name the --tls-server-name")
    source.add_argument("--tls-self-signed", action="store_true",
                        help="make a CA and those files in a temporary directory (removed on "
                             "exit); the startup message shows its ca.crt")
    tls.add_argument("--tls-client-auth", action="store_true",
                     help="the listener requires a client certificate signed by ca.crt; the "
                          "printed lines present client.crt")
    tls.add_argument("--tls-server-name", default=SNI, metavar="NAME",
                     help="the name server.crt carries (--tls-self-signed writes it), which "
                          "every hop verifies and the printed lines send as SNI (default: "
                          "%(default)s)")
    tls.add_argument("--tls-handshake-timeout", type=float, default=HANDSHAKE_TIMEOUT,
                     metavar="SECONDS",
                     help="every TLS server drops a client that has not finished its handshake "
                          "this long after connecting (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [kvswitch up] %(message)s",
                        datefmt="%H:%M:%S")
    state_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvswitch-up-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    with_frontend = not args.no_frontend and frontend_available()
    if not args.no_frontend and not with_frontend:
        logger.warning("kvswitch.frontend is not installed: serving gRPC only")
    try:
        tls = _tls_dir(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    try:
        return _run(args, state_dir, with_frontend, tls)
    finally:
        if args.tls_self_signed and tls is not None:
            shutil.rmtree(tls.path, ignore_errors=True)


def _tls_dir(args: argparse.Namespace) -> TlsDir | None:
    if not args.tls_handshake_timeout > 0:
        raise ValueError("--tls-handshake-timeout must be positive")
    check_server_name(args.tls_server_name)
    if args.tls_self_signed:
        directory = write_self_signed(Path(tempfile.mkdtemp(prefix="kvswitch-tls-")),
                                      args.tls_server_name)
    elif args.tls_dir is not None:
        directory = TlsDir(args.tls_dir.resolve())
        if missing := directory.missing():
            raise ValueError(f"--tls-dir {args.tls_dir}: missing {', '.join(missing)}")
    elif args.tls_client_auth or args.tls_server_name != SNI:
        raise ValueError("--tls-client-auth and --tls-server-name need --tls-dir or "
                         "--tls-self-signed")
    else:
        return None
    return TlsDir(directory.path, sni=args.tls_server_name,
                  handshake_timeout=args.tls_handshake_timeout, client_auth=args.tls_client_auth)


def _run(args: argparse.Namespace, state_dir: Path, with_frontend: bool,
         tls: TlsDir | None) -> int:
    spec = GatewaySpec(
        port=args.port, admin_port=args.admin_port, replicas=args.replicas,
        profile=args.profile, time_scale=args.time_scale, mode=args.mode,
        grace_period=args.grace_period, epp_config=args.epp_config,
        epp_replicas=args.epp_replicas,
        frontend_workers=args.frontend_workers if with_frontend else 0,
        envoy_concurrency=args.envoy_concurrency, routing=args.routing, restart_engines=True,
        restart_epp=True, restart_proxies=True, api=args.api,
        engine_args=engine_args(args),
        tls=tls,
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
        print(startup_message(gateway.ports, with_frontend, state_dir, args.api, tls),
              flush=True)
        return _supervise(supervisor, stop_requested)
    except (RuntimeError, TimeoutError) as exc:
        logger.error("%s", exc)
        return 1
    finally:
        logger.info("stopping %d processes", len(supervisor.children))
        supervisor.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def engine_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The `kvswitch engine` flags `kvswitch up` passes through when set."""
    out: tuple[str, ...] = ()
    if args.page_size:
        out += ("--page-size", str(args.page_size))
    if args.load_push_ms is not None:
        out += ("--load-push-ms", f"{args.load_push_ms:g}")
    return out


def _supervise(supervisor: Supervisor, stop_requested: list[int]) -> int:
    while not stop_requested:
        events: list[ChildExited] = supervisor.poll()
        for event in events:
            if event.restarted_pid is not None:
                continue
            if event.name.startswith("epp-") and _alive(supervisor, "epp-"):
                logger.error("%s keeps exiting: no more restarts, Envoy routes through the "
                             "other EPPs", event.name)
                continue
            if not event.name.startswith("engine-"):
                logger.error("%s exited: shutting everything down", event.name)
                return 1
            logger.error("%s keeps exiting: no more restarts, the pool is one replica smaller",
                         event.name)
        time.sleep(0.2)
    logger.info("received signal %d", stop_requested[0])
    return 0


def _alive(supervisor: Supervisor, prefix: str) -> bool:
    return any(c.alive() for c in supervisor.children if c.name.startswith(prefix))


@dataclass(frozen=True, slots=True)
class _Caller:
    """How the printed lines reach the gateway on 127.0.0.1: plaintext, or TLS verified against
    ca.crt as the server name (sent as SNI), with client.crt when the listener asks for it."""

    port: int
    address: str
    grpcurl: str
    """grpcurl's transport flags."""
    channel: str
    """A Python expression making the grpc channel."""
    url: str
    """The OpenAI API's base URL."""
    curl: str = ""
    """curl's TLS flags, with a trailing space (none for plaintext)."""
    ssl: ssl.SSLContext | None = None
    name: str = "127.0.0.1"
    """The host the URL names: the server name with TLS."""


def _caller(port: int, tls: TlsDir | None) -> _Caller:
    address = f"127.0.0.1:{port}"
    if tls is None:
        return _Caller(port, address, "-plaintext", f"grpc.insecure_channel('{address}')",
                       f"http://{address}")
    name, ca = tls.sni, tls.ca
    context = ssl.create_default_context(cafile=ca)
    grpcurl, curl, credentials = f"-cacert {ca}", f"--cacert {ca}", [f"open('{ca}', 'rb').read()"]
    if tls.client_auth:
        client = tls.client()
        assert client.cert is not None and client.key is not None
        context.load_cert_chain(client.cert, client.key)
        grpcurl += f" -cert {client.cert} -key {client.key}"
        curl += f" --cert {client.cert} --key {client.key}"
        credentials += [f"open('{client.key}', 'rb').read()", f"open('{client.cert}', 'rb').read()"]
    channel = (f"grpc.secure_channel('{address}', grpc.ssl_channel_credentials("
               f"{', '.join(credentials)}), options=[('grpc.ssl_target_name_override', '{name}')])")
    return _Caller(port, address, f"{grpcurl} -authority {name}", channel,
                   f"https://{name}:{port}", f"{curl} --resolve {name}:{port}:127.0.0.1 ",
                   context, name)


def served_model(caller: _Caller) -> str:
    """The first model id the frontend lists (what the printed curl line must name)."""
    connection = http.client.HTTPConnection(caller.name, caller.port, timeout=5.0)
    try:
        if caller.ssl is not None:  # to 127.0.0.1, whatever the server name resolves to
            raw = socket.create_connection(("127.0.0.1", caller.port), timeout=5.0)
            connection.sock = caller.ssl.wrap_socket(raw, server_hostname=caller.name)
        connection.request("GET", "/v1/models")
        return str(json.loads(connection.getresponse().read())["data"][0]["id"])
    except (OSError, http.client.HTTPException, KeyError, IndexError, TypeError, ValueError):
        return "default"
    finally:
        connection.close()


def _epp_metrics_urls(ports: Ports) -> str:
    return " ".join(f"http://127.0.0.1:{port}/metrics" for port in ports.epp_metrics)


def _sglang_usage(caller: _Caller, proto_dir: Path) -> list[str]:
    """How to call an SGLang pool: SglangScheduler takes tokenized input."""
    return [
        "",
        "gRPC (grpcurl; SGLang's API takes token ids):",
        (f"  grpcurl {caller.grpcurl} -import-path {proto_dir} -proto sglang_scheduler.proto "
         "-d '{\"request_id\": \"req-1\", \"tokenized\": {\"input_ids\": [9707, 1879]}, "
         "\"sampling_params\": {\"max_new_tokens\": 10, \"temperature\": 1, \"top_p\": 1}, "
         f"\"stream\": true}}' {caller.address} "
         "sglang.grpc.scheduler.SglangScheduler/Generate"),
        "",
        "gRPC (Python):",
        f"  {sys.executable} - <<'EOF'",
        "import grpc",
        ("from kvswitch.protocol.sglang import sglang_scheduler_pb2 as pb, "
         "sglang_scheduler_pb2_grpc as rpc"),
        f"stub = rpc.SglangSchedulerStub({caller.channel})",
        "request = pb.GenerateRequest(request_id='req-2', stream=True,",
        "                             tokenized=pb.TokenizedInput(input_ids=[9707, 1879]),",
        "                             sampling_params=pb.SamplingParams(max_new_tokens=10,",
        "                                                               temperature=1, top_p=1))",
        "for response in stub.Generate(request):",
        "    print(response)",
        "EOF",
    ]


def startup_message(ports: Ports, with_frontend: bool, state_dir: Path,
                    api: str = "vllm", tls: TlsDir | None = None) -> str:
    caller = _caller(ports.public, tls)
    proto_dir = Path(importlib.util.find_spec("smg_grpc_proto").origin  # type: ignore[union-attr]
                     or "").parent / "proto"
    lines = _sglang_usage(caller, proto_dir) if api == "sglang" else [
        "",
        "gRPC (grpcurl):",
        (f"  grpcurl {caller.grpcurl} -import-path {proto_dir} -proto vllm_engine.proto "
         "-H 'x-llm-d-inference-fairness-id: tenant-a' "
         "-d '{\"request_id\": \"req-1\", \"text\": \"Hello\", "
         "\"sampling_params\": {\"max_tokens\": 10}, \"stream\": true}' "
         f"{caller.address} vllm.grpc.engine.VllmEngine/Generate"),
        "",
        "gRPC (Python):",
        f"  {sys.executable} - <<'EOF'",
        "import grpc",
        "from kvswitch.protocol import vllm_engine_pb2 as pb, vllm_engine_pb2_grpc as rpc",
        f"stub = rpc.VllmEngineStub({caller.channel})",
        "request = pb.GenerateRequest(request_id='req-2', text='Hello', stream=True,",
        "                             sampling_params=pb.SamplingParams(max_tokens=10))",
        ("for response in stub.Generate(request, metadata=[('x-llm-d-inference-fairness-id', "
         "'tenant-a')]):"),
        "    print(response)",
        "EOF",
    ]
    lines.insert(0, "")
    security = "plaintext" if tls is None else (
        f"TLS on every hop{', client certificate required' if tls.client_auth else ''}, "
        f"CA {tls.ca}")
    lines.insert(1, (f"kvswitch is up on 127.0.0.1:{ports.public}  ({security}; Envoy admin "
                     f"127.0.0.1:{ports.admin}, EPP metrics {_epp_metrics_urls(ports)}, "
                     f"logs {state_dir})"))
    if with_frontend:
        body = json.dumps({"model": served_model(caller), "max_tokens": 10,
                           "messages": [{"role": "user", "content": "Hello"}]})
        lines += [
            "",
            "OpenAI HTTP:",
            (f"  curl -s {caller.curl}{caller.url}/v1/chat/completions "
             "-H 'content-type: application/json' "
             f"-d '{body}'"),
        ]
    lines += ["", "Ctrl-C stops everything.", ""]
    return "\n".join(lines)
