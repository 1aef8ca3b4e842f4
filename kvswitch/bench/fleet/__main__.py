"""`python -m kvswitch.bench.fleet`: one workload (a preset ladder or a trace slice), several
routers, in the fleet simulator; prints engine-side figures per router and step, writes JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvswitch.bench.fleet import make_router, run_fleet
from kvswitch.bench.trace import TraceWorkload, ideal_prefix_hit_ratio, load_trace
from kvswitch.bench.workloads import ARRIVALS, PRESETS, Arrivals, Workload, build_workload
from kvswitch.engine.sim.events import LOAD_PUSH_SECONDS
from kvswitch.engine.sim.profiles import get_profile
from kvswitch.tokenization import load_tokenizer


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvswitch.bench.fleet", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--routers", default="round-robin,oracle,smg-cache-aware-model,kvswitch",
                        help="comma-separated: round-robin, random, oracle, oracle-conserve, "
                             "oracle-lookahead, smg-cache-aware-model, kvswitch, epp:PATH|NAME")
    parser.add_argument("--preset", default="shared-prefix-150x5-6000-1200-1000",
                        choices=sorted(PRESETS))
    parser.add_argument("--qps", type=_floats, default=None, help="default: the preset's")
    parser.add_argument("--duration", type=float, default=None,
                        help="simulated seconds per step (default: the preset's)")
    parser.add_argument("--arrivals", default="poisson", choices=list(ARRIVALS))
    parser.add_argument("--trace", type=Path, default=None, help="a Mooncake JSONL trace")
    parser.add_argument("--trace-start", type=float, default=0.0)
    parser.add_argument("--trace-duration", type=float, default=None)
    parser.add_argument("--speedup", type=float, default=1.0)
    parser.add_argument("--profile", default=None,
                        help="default: qwen3-32b-2xh100, or its 128k variant for a trace")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--kv-delay", type=float, default=0.002)
    parser.add_argument("--load-push-ms", type=float, default=LOAD_PUSH_SECONDS * 1000,
                        help="replicas push their load this long after an arrival to a router "
                             "with several KV-event streams each (kvswitch@N); 0: never")
    parser.add_argument("--no-queued-prompts", dest="queued_prompts", action="store_false",
                        help="load pushes carry no prompts of queued requests (each EPP sees "
                             "the others' sends only as load until the engine stores them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(None)
    workload: TraceWorkload | Workload
    if args.trace is not None:
        profile = get_profile(args.profile or "qwen3-32b-2xh100-128k")
        workload = load_trace(args.trace, tokenizer, start=args.trace_start,
                              duration=args.trace_duration, speedup=args.speedup,
                              max_model_len=profile.max_model_len, seed=args.seed)
    else:
        profile = get_profile(args.profile or "qwen3-32b-2xh100")
        preset = PRESETS[args.preset]
        workload = build_workload(preset.shape, args.qps or preset.qps,
                                  args.duration or preset.stage_duration, tokenizer,
                                  seed=args.seed, arrivals_shape=Arrivals(args.arrivals))
    ideal = ideal_prefix_hit_ratio(workload.requests)
    print(f"{len(workload.requests)} requests; ideal prefix-hit ratio {ideal:.3f}")
    results = []
    for name in (n.strip() for n in args.routers.split(",") if n.strip()):
        result = run_fleet(workload, make_router(name, args.seed, args.kv_delay), profile,
                           args.replicas, seed=args.seed,
                           load_push_seconds=args.load_push_ms / 1000,
                           queued_prompts=args.queued_prompts)
        results.append(result.to_json())
        for step in result.steps:
            print(f"{name:24} qps {step['qps']:6.3g}  TTFT p50 {step['ttft_p50'] or 0:7.3f} "
                  f"p90 {step['ttft_p90'] or 0:7.3f} p99 {step['ttft_p99'] or 0:7.3f}  "
                  f"hit {step['cache_hit_rate'] or 0:.3f}  per replica "
                  f"{step['requests_per_replica']}")
        if result.rejected or result.unfinished:
            print(f"{name:24} rejected {len(result.rejected)}, unfinished "
                  f"{len(result.unfinished)}")
    if args.out is not None:
        args.out.write_text(json.dumps({"ideal_prefix_hit_ratio": ideal, "results": results},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
