"""`kvswitch engine`: serve the vLLM (or, with `--api sglang`, SGLang) gRPC engine API with the
simulated model server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

from kvswitch.cli import DefaultsHelpFormatter
from kvswitch.engine.server import EngineServer, ServerOptions
from kvswitch.limits import (
    add_message_flags,
    add_sampling_flags,
    message_from_args,
    sampling_from_args,
)
from kvswitch.tls import add_tls_flags, tls_from_args
from kvswitch.tokenization import load_tokenizer

logger = logging.getLogger("kvswitch.engine")

# CLI flag (argparse dest) -> SimConfig field; unset flags keep the simulator's defaults.
_SIM_FIELDS = {
    "model": "served_model_name",
    "tokenizer": "tokenizer_dir",
    "profile": "profile",
    "step_model": "step_model",
    "time_scale": "time_scale",
    "mode": "mode",
    "seed": "seed",
    "kv_events_coalesce": "kv_events_coalesce_seconds",
    "load_push": "kv_load_push_seconds",
    "max_model_len": "max_model_len",
    "block_size": "block_size",
    "num_gpu_blocks": "num_gpu_blocks",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "mean_output_len": "mean_output_len",
    "embedding_dim": "embedding_dim",
    "failure_rate": "failure_rate",
    "failure_kind": "failure_kind",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsHelpFormatter
    parser.description = (
        "Serve vllm.grpc.engine.VllmEngine (every RPC, vLLM semantics; or with --api sglang "
        "sglang.grpc.scheduler.SglangScheduler, SGLang's), grpc.health.v1 and "
        "server reflection on one gRPC port, backed by the simulated model server (continuous "
        "batching, paged KV cache with prefix caching, a step-time model). Optional Prometheus "
        "/metrics with vLLM's metric names on --http-port; its latency histograms (TTFT, "
        "inter-token, e2e, queue time) are in SIMULATED seconds, comparable with a real vLLM's "
        "at any --time-scale (equal to wall seconds at 1). SIGTERM drains gracefully.")
    net = parser.add_argument_group("serving")
    net.add_argument("--api", choices=["vllm", "sglang"], default="vllm",
                     help="gRPC API: vllm.grpc.engine.VllmEngine (vLLM's semantics) or "
                          "sglang.grpc.scheduler.SglangScheduler (SGLang's; docs/sglang.md)")
    net.add_argument("--page-size", type=int, default=1, metavar="N",
                     help="--api sglang: the radix cache's page size its KV events report, as "
                          "SGLang's --page-size (must divide the KV block size)")
    net.add_argument("--host", default="127.0.0.1", help="address to bind")
    net.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    net.add_argument("--http-port", type=int, default=None,
                     help="serve /metrics and /health on this port (default: no HTTP server)")
    net.add_argument("--grace-period", type=float, default=30.0,
                     help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    net.add_argument("--request-log", type=Path, default=None, metavar="PATH",
                     help="append one JSON line per finished request to PATH (request_id, "
                          "wall arrival, and in engine seconds: arrival, queue, TTFT, e2e, mean "
                          "ITL; prompt/cached/completion tokens, finish reason); buffered, "
                          "written every second and at shutdown")
    net.add_argument("--log-level", default="INFO",
                     choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    model = parser.add_argument_group("model (unset: the simulator's defaults)")
    model.add_argument("--model", default=None, help="served model name")
    model.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="Hugging Face tokenizer directory (default: the bundled Qwen3)")
    model.add_argument("--profile", default=None,
                       help="hardware/model profile: llama3-8b-h100 (default), "
                            "qwen3-32b-2xh100, qwen3-32b-2xh100-128k, tiny")
    model.add_argument("--step-model", choices=["roofline", "linear"], default=None,
                       help="step-time model: roofline (from the model and GPU configs; each "
                            "step's time grows with the contexts it reads) or linear (the "
                            "context-blind fit); default: the profile's (tiny: linear)")
    model.add_argument("--time-scale", type=float, default=None, metavar="X",
                       help="run the simulated clock X times faster than real time "
                            "(/metrics latencies stay in simulated seconds)")
    model.add_argument("--mode", choices=["echo", "random"], default=None,
                       help="output tokens: echo the prompt, or random (seeded)")
    model.add_argument("--seed", type=int, default=None, help="simulator random seed")
    model.add_argument("--mean-output-len", type=int, default=None, metavar="N",
                       help="mean output length when max_tokens is unset")
    model.add_argument("--embedding-dim", type=int, default=None, metavar="N",
                       help="Embed vector size")
    sched = parser.add_argument_group("scheduler and KV cache (unset: the profile's values)")
    sched.add_argument("--max-model-len", type=int, default=None, metavar="N")
    sched.add_argument("--block-size", type=int, default=None, metavar="N")
    sched.add_argument("--num-gpu-blocks", type=int, default=None, metavar="N")
    sched.add_argument("--max-num-seqs", type=int, default=None, metavar="N")
    sched.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N")
    sched.add_argument("--kv-events-coalesce-ms", type=lambda ms: float(ms) / 1000,
                       dest="kv_events_coalesce", default=None, metavar="MS",
                       help="publish KV events (SubscribeKvEvents) at most once per MS wall "
                            "milliseconds, merging steps in order (default 50; 0: every step); "
                            "a cache clear goes out at once")
    sched.add_argument("--load-push-ms", type=lambda ms: float(ms) / 1000, dest="load_push",
                       default=None, metavar="MS",
                       help="with two or more KV-event subscribers (several EPPs), send them "
                            "the engine's load MS wall milliseconds after a request arrives, "
                            "and at least 5 ms after the previous push, with the prompts still "
                            "in prefill that arrived since the last, to those that ask "
                            "(default 1; 0: never)")
    add_sampling_flags(parser)
    add_message_flags(parser)
    add_tls_flags(parser)
    faults = parser.add_argument_group("failure injection")
    faults.add_argument("--failure-rate", type=float, default=None, metavar="F",
                        help="fraction of requests that fail (0-1)")
    faults.add_argument("--failure-kind", default=None,
                        choices=["internal", "unavailable", "abort"],
                        help="injected failure: INTERNAL or UNAVAILABLE before any output, or "
                             "finish_reason abort after the first token")


def sim_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {field: getattr(args, dest) for dest, field in _SIM_FIELDS.items()
            if getattr(args, dest, None) is not None}


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level,
                        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency, but stay runnable
        runner = asyncio.run
    # grpc.aio hands every completion (a new RPC, a sent message) from its poller thread to
    # the event loop; while the loop is busy that thread waits for the GIL up to the switch
    # interval (5 ms by default), which caps accepted RPCs at a few hundred per second.
    sys.setswitchinterval(float(os.environ.get("KVSWITCH_SWITCH_INTERVAL", "0.0002")))
    main = _serve(args)
    try:
        runner(main)
    except (ValueError, OSError) as exc:
        # Bad configuration (unknown profile, KV too small) or a port in use: say so plainly.
        logger.error("kvswitch engine: %s", exc)
        return 2
    return 0


async def _serve(args: argparse.Namespace) -> None:
    from kvswitch.engine.sim import SimConfig, SimEngine

    config = SimConfig(**sim_config_kwargs(args), max_logprobs=args.max_logprobs)
    engine = SimEngine(config)
    tokenizer = load_tokenizer(args.tokenizer)
    description = (f"profile={getattr(config, 'profile', '?')} "
                   f"time_scale={getattr(config, 'time_scale', '?')} "
                   f"mode={getattr(config, 'mode', '?')}")
    options = ServerOptions(host=args.host, port=args.port, http_port=args.http_port,
                            grace_period=args.grace_period, tokenizer_dir=args.tokenizer,
                            description=f"api={args.api} {description}", api=args.api,
                            page_size=args.page_size, sampling_limits=sampling_from_args(args),
                            message_limits=message_from_args(args), tls=tls_from_args(args))
    server = EngineServer(engine, tokenizer, options)
    request_log = None
    if args.request_log is not None:
        from kvswitch.engine.request_log import RequestLog

        request_log = server.servicer.request_log = RequestLog(args.request_log)
        request_log.start()
    try:
        await server.start()
        await server.run_until_signal()
    finally:
        if request_log is not None:
            await request_log.close()
