"""`kvswitch bench`: the same workload against several targets on one cold engine pool.

Starts `--replicas` simulated engines (`--profile`, `--time-scale`) on loopback, then for each
target in turn: flush every engine's prefix cache, start the target's gateway processes, replay
the workload (Poisson arrivals over the QPS ladder), stop them. Writes results.json,
requests.json, summary.md and PNG plots to `--out`. Every process it starts is stopped by PID
on exit, and every run ends by itself (ladder duration + drain timeout).

Measurement: the headline is what the engines logged (`kvswitch engine --request-log`, one line
per request on the engine's clock; `kvswitch.bench.engine_report`), the same for every target;
the client's numbers are kept beside them. Requests are not streamed by default for the
shared-prefix presets, so the gateway and the client handle one message per request and the CPU
goes to the engines' steps.

CPU budget (2 cores, measured with 3 replicas at 8-replica per-replica load, non-streamed, on a
machine loaded by other work): per engine ~0.1 core per unit of time scale at ~3.7 QPS per
replica, the EPP ~0.08 per 3 replicas, the client and Envoy < 0.05; the oracle's client ~0.16
per 3 engines (it indexes every engine's KV events). 8 replicas need ~1.2-1.6 cores at time scale
1: the presets default to 1. The report's clock slip says whether the engines kept up (near 0);
if not, lower `--time-scale`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvswitch.bench.contracts import RunContext, TargetUnavailable
from kvswitch.bench.engines import EnginePool
from kvswitch.bench.report import target_summary, write_report
from kvswitch.bench.runner import TargetRun, run_target
from kvswitch.bench.targets import TARGET_NAMES, make_target
from kvswitch.bench.trace import TraceWorkload, ideal_prefix_hit_ratio, load_trace
from kvswitch.bench.workloads import (
    ARRIVALS,
    PRESETS,
    Arrivals,
    SharedPrefixShape,
    build_workload,
)
from kvswitch.cli import DefaultsHelpFormatter
from kvswitch.engine.sim.profiles import PROFILES, get_profile
from kvswitch.supervisor import Supervisor
from kvswitch.tokenization import load_tokenizer

log = logging.getLogger("kvswitch.bench")


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsHelpFormatter
    parser.add_argument("--preset", default="shared-prefix-150x5-6000-1200-1000",
                        choices=sorted(PRESETS),
                        help="workload shape and default QPS ladder; a multi-turn preset's "
                             "conversations run as user sessions: a next turn waits for the "
                             "previous one and carries the answer the engine gave")
    parser.add_argument("--targets", default="kvswitch,round-robin,oracle",
                        help=f"comma-separated: {', '.join(TARGET_NAMES)}, or kvswitch:CONFIG; "
                             "@N after an EPP target runs N EPPs behind its Envoy (kvswitch@2)")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--profile", default="qwen3-32b-2xh100", choices=sorted(PROFILES),
                        help="engine profile (a --trace needs one whose max_model_len holds its "
                             "prompts, e.g. qwen3-32b-2xh100-128k)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="engines run X times faster than real time; latencies are "
                             "reported in simulated seconds (default: the preset's; keep the "
                             "report's clock slip near 0)")
    parser.add_argument("--qps", type=_floats, default=None,
                        help="QPS ladder, simulated requests/s (default: the preset's)")
    parser.add_argument("--duration", type=float, default=None,
                        help="simulated seconds per QPS step (default: the preset's)")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="stop generating requests after this many")
    parser.add_argument("--groups", type=int, default=None,
                        help="override the preset's num_groups (scale a workload down)")
    parser.add_argument("--arrivals", default="poisson", choices=list(ARRIVALS),
                        help="poisson: one request at a time; bursts: --burst-min..--burst-max "
                             "requests at once, the same mean rate")
    parser.add_argument("--burst-min", type=int, default=10)
    parser.add_argument("--burst-max", type=int, default=50)
    parser.add_argument("--trace", type=Path, default=None,
                        help="replay a Mooncake JSONL trace (timestamp ms, input_length, "
                             "output_length, hash_ids of 512-token blocks) instead of --preset; "
                             "see kvswitch.bench.trace")
    parser.add_argument("--trace-start", type=float, default=0.0,
                        help="trace seconds to start the slice at")
    parser.add_argument("--trace-duration", type=float, default=None,
                        help="trace seconds in the slice (default: to the end)")
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="replay the trace this many times faster than recorded")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drain-timeout", type=float, default=300.0,
                        help="wall seconds to wait for stragglers after the last send")
    parser.add_argument("--api", default="vllm", choices=["vllm", "sglang"],
                        help="the engines' gRPC API (every target speaks it; docs/sglang.md)")
    parser.add_argument("--page-size", type=int, default=None,
                        help="--api sglang: the engines' radix-cache page size (default 1)")
    parser.add_argument("--load-push-ms", type=float, default=None, metavar="MS",
                        help="engines send their load to several EPPs MS ms after an arrival "
                             "(kvswitch engine --load-push-ms; default: the engine's, 1; 0: "
                             "never)")
    parser.add_argument("--mode", default="random", choices=["random", "echo"],
                        help="engine output tokens")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                        help="ask for streamed output (client-side TTFT/ITL, but every token "
                             "crosses the gateway and the client: CPU); default: the preset's "
                             "(shared-prefix presets: not streamed, TTFT from the engines' "
                             "request logs)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--log-level", default="WARNING")


def run(args: argparse.Namespace) -> int:
    if args.time_scale is None:
        args.time_scale = PRESETS[args.preset].time_scale
    logging.basicConfig(level=args.log_level, format="%(levelname)s [%(name)s] %(message)s")
    try:
        report = asyncio.run(_bench(args))
    except KeyboardInterrupt:
        return 130
    print(f"wrote {args.out}/summary.md")
    print((args.out / "summary.md").read_text())
    return 0 if report else 1


def _workload(args: argparse.Namespace) -> Any:
    if args.trace is not None:
        return load_trace(args.trace, load_tokenizer(None), start=args.trace_start,
                          duration=args.trace_duration, speedup=args.speedup,
                          max_model_len=get_profile(args.profile).max_model_len,
                          seed=args.seed, max_requests=args.max_requests)
    preset = PRESETS[args.preset]
    shape = preset.shape
    if args.groups:
        shape = SharedPrefixShape(**{**_asdict(shape), "num_groups": args.groups})
    return build_workload(shape, args.qps or preset.qps, args.duration or preset.stage_duration,
                          load_tokenizer(None), seed=args.seed, max_requests=args.max_requests,
                          arrivals_shape=Arrivals(args.arrivals, args.burst_min, args.burst_max))


def _workload_meta(workload: Any) -> dict[str, Any]:
    """What the report says about the workload: its shape, or the trace slice it replays."""
    if isinstance(workload, TraceWorkload):
        return {"trace": {"source": workload.source, "start": workload.start,
                          "duration": workload.duration, "speedup": workload.speedup,
                          **workload.meta, "skipped_rows": list(workload.skipped),
                          "ideal_hit_ratio": workload.ideal_hit_ratio}}
    return {"shape": _asdict(workload.shape)}


def _asdict(shape: SharedPrefixShape) -> dict[str, Any]:
    return {f: getattr(shape, f) for f in shape.__slots__}


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    targets = [make_target(t.strip()) for t in args.targets.split(",") if t.strip()]
    stream = PRESETS[args.preset].stream if args.stream is None else args.stream
    workload = await asyncio.to_thread(_workload, args)
    if isinstance(workload, TraceWorkload) and workload.skipped:
        print(f"{len(workload.skipped)} trace rows are longer than the profile's max_model_len "
              "and are not replayed (listed in results.json)", file=sys.stderr)
    ladder = workload.stage_duration * len(workload.qps) / args.time_scale
    print(f"{len(workload.requests)} requests over {len(workload.qps)} QPS steps "
          f"({workload.stage_duration:g} simulated s each = "
          f"{workload.stage_duration / args.time_scale:.1f} wall s at time scale "
          f"{args.time_scale:g}): {ladder / 60:.1f} wall min per target plus its drain (up to "
          f"{args.drain_timeout / 60:.1f} min)", file=sys.stderr)
    runs: list[TargetRun] = []
    with tempfile.TemporaryDirectory(prefix="kvswitch-bench-") as tmp:
        state = Path(tmp)
        with Supervisor(state / "logs") as supervisor:
            extra: tuple[str, ...] = (
                ("--page-size", str(args.page_size)) if args.page_size else ())
            if args.load_push_ms is not None:
                extra += ("--load-push-ms", f"{args.load_push_ms:g}")
            pool = EnginePool(supervisor, args.replicas, args.profile, args.time_scale,
                              args.mode, extra_args=extra, request_log_dir=state / "requests",
                              api=args.api)
            await asyncio.to_thread(pool.start)
            ctx = RunContext(supervisor, pool, state)
            for target in targets:
                try:
                    runs.append(await run_target(target, workload, ctx, args.time_scale,
                                                 args.drain_timeout,
                                                 progress=not args.no_progress, stream=stream))
                except TargetUnavailable as exc:
                    print(f"{target.name}: unavailable: {exc}", file=sys.stderr)
                    runs.append(TargetRun(target.name, (), {}, 0.0, unavailable=str(exc)))
    report = {
        "meta": {
            "preset": args.preset if args.trace is None else f"trace {args.trace.name}",
            "command": "kvswitch bench " + shlex.join(sys.argv[2:])
            if sys.argv[1:2] == ["bench"] else shlex.join(sys.argv),
            "replicas": args.replicas, "profile": args.profile, "time_scale": args.time_scale,
            "api": args.api,
            "qps": list(workload.qps), "stage_duration": workload.stage_duration,
            "seed": args.seed, "requests": len(workload.requests), "stream": stream,
            **_workload_meta(workload), "arrivals": args.arrivals,
            "ideal_prefix_hit_ratio": ideal_prefix_hit_ratio(workload.requests),
            "latency_unit": "simulated seconds",
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "targets": [target_summary(r, workload.qps, workload.stage_duration, args.time_scale)
                    for r in runs],
    }
    write_report(report, runs, args.out)
    return report
