"""`kvswitch frontend`: serve the OpenAI API over HTTP (HTTPS with `--tls-cert`) and call a vLLM
gRPC target (over TLS with `--target-tls-ca`).

Our own HTTP/1.1 server (`http_server`, httptools) on uvloop. `--workers N` starts N processes that
each bind the same port with SO_REUSEPORT (the kernel spreads connections across them); each builds
its own event loop and gRPC channel after it starts, never inheriting one across a fork.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import signal
import socket
import sys
from types import FrameType

from kvswitch.frontend.app import DEFAULT_MAX_BODY_BYTES, FrontendSettings
from kvswitch.frontend.parsing import REASONING_PARSERS, TOOL_CALL_PARSERS
from kvswitch.limits import HttpLimits, add_http_flags, http_from_args
from kvswitch.tls import (
    add_tls_flags,
    add_upstream_tls_flags,
    server_ssl_context,
    tls_from_args,
    upstream_tls_from_args,
)

__all__ = ["add_arguments", "run"]

logger = logging.getLogger("kvswitch.frontend")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="HOST:PORT",
                        help="vLLM gRPC target: Envoy's listener or one engine")
    parser.add_argument("--api", choices=["auto", "vllm", "sglang"], default="auto",
                        help="the target's gRPC API: vllm.grpc.engine.VllmEngine, "
                             "sglang.grpc.scheduler.SglangScheduler, or auto (found from its "
                             "GetModelInfo answer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--workers", type=int, default=1,
                        help="processes sharing the port (SO_REUSEPORT)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="tokenizer directory (default: the target's GetTokenizer, "
                             "else the bundled Qwen3 tokenizer)")
    parser.add_argument("--served-model-name", nargs="+", default=[],
                        help="names clients may use (default: the target's served_model_name)")
    parser.add_argument("--user-as-fairness-id", action="store_true",
                        help="use the OpenAI `user` field as x-llm-d-inference-fairness-id")
    add_http_flags(parser, defaults=HttpLimits(max_body_bytes=DEFAULT_MAX_BODY_BYTES))
    parser.add_argument("--tool-call-parser", default="auto", metavar="NAME",
                        help="tool-call format of the model's output: " +
                        ", ".join(sorted(TOOL_CALL_PARSERS)) + "; auto (from the chat "
                        "template) or none")
    parser.add_argument("--reasoning-parser", default="auto", metavar="NAME",
                        help="reasoning format of the model's output: " +
                        ", ".join(sorted(REASONING_PARSERS)) + "; auto (from the chat "
                        "template) or none")
    add_tls_flags(parser)
    add_upstream_tls_flags(parser, "target", "target")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error", "critical"])


def _settings(args: argparse.Namespace) -> FrontendSettings:
    return FrontendSettings(target=args.target,
                            served_model_names=tuple(args.served_model_name),
                            tokenizer_dir=args.tokenizer,
                            user_as_fairness_id=args.user_as_fairness_id,
                            max_body_bytes=args.max_body_bytes,
                            tool_call_parser=args.tool_call_parser,
                            reasoning_parser=args.reasoning_parser, api=args.api,
                            target_tls=upstream_tls_from_args(args, "target"))


def _bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(args: argparse.Namespace, reuse_port: bool) -> None:
    """One worker: bind, build the app on this process's loop, serve until SIGTERM/SIGINT."""
    import uvloop

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = _bind(args.host, args.port, reuse_port)
    uvloop.run(_serve(args, sock))


async def _serve(args: argparse.Namespace, sock: socket.socket) -> None:
    import asyncio

    from kvswitch.frontend.app import Frontend
    from kvswitch.frontend.http_server import Server

    app = Frontend(_settings(args))
    tls = tls_from_args(args)
    server = Server(app, http_from_args(args),
                    ssl=server_ssl_context(tls, alpn="http/1.1") if tls is not None else None,
                    ssl_handshake_timeout=tls.handshake_timeout if tls is not None else None)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, server.stop)
    try:
        await server.serve(sock, on_started=app.startup)
    finally:
        await app.shutdown()


def run(args: argparse.Namespace) -> int:
    from kvswitch.frontend.chat_output import ParserSettings

    try:
        ParserSettings(args.tool_call_parser, args.reasoning_parser)
    except ValueError as exc:
        print(f"kvswitch frontend: {exc}", file=sys.stderr)
        return 2
    if args.workers <= 1:
        serve(args, reuse_port=False)
        return 0
    # spawn, not fork: a worker must not inherit gRPC or event-loop state from this process.
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=serve, args=(args, True), name=f"frontend-{i}")
               for i in range(args.workers)]
    for worker in workers:
        worker.start()

    def stop(signum: int, frame: FrameType | None) -> None:
        for worker in workers:
            if worker.is_alive() and worker.pid is not None:
                worker.terminate()  # SIGTERM to that worker's pid: it shuts down cleanly

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    failed = 0
    for worker in workers:
        worker.join()
        if worker.exitcode not in (0, -signal.SIGTERM):
            failed = 1
            print(f"frontend worker {worker.name} exited with {worker.exitcode}", file=sys.stderr)
            stop(signal.SIGTERM, None)
    return failed
