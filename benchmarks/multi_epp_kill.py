"""Routing quality around the death of one of several EPPs, in the fleet simulator.

One workload (a preset at one rate), three runs with the same seed: N EPPs throughout; N EPPs
with replica 0 killed at `--kill-at` seconds (`MultiEppRouter.kill`: from then on the survivors
route every request, and the requests it had in flight are in nobody's count); and N - 1 EPPs
throughout. Per window of arrival time (`--window` seconds), each run's engine-side TTFT p50 /
p90 and prefix-cache hit ratio of the requests that arrived in it. What the death costs the
survivors' routing is the killed run against the two others in the windows after it.

What it leaves out: Envoy's part (retrying the ext_proc streams the dead EPP held, ejecting it),
which `tests/e2e/test_multi_epp.py` checks with real processes, and a restart (the fleet keeps
no KV-event history to replay).

    python benchmarks/multi_epp_kill.py --epps 3 --qps 18 --out kill.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvswitch.bench.engine_report import percentile
from kvswitch.bench.fleet import FleetContext, FleetResult, MultiEppRouter, run_fleet
from kvswitch.bench.workloads import PRESETS, Arrivals, build_workload
from kvswitch.engine.request_log import RequestRecord
from kvswitch.engine.sim.profiles import get_profile
from kvswitch.launcher import DEFAULT_EPP_CONFIG
from kvswitch.tokenization import load_tokenizer


class KilledAt(MultiEppRouter):
    """`MultiEppRouter` whose replica 0 dies at `at` virtual seconds."""

    def __init__(self, replicas: int, at: float, name: str, seed: int) -> None:
        super().__init__(DEFAULT_EPP_CONFIG, replicas, name, seed=seed)
        self.at = at

    def setup(self, ctx: FleetContext) -> None:
        super().setup(ctx)
        ctx.call_at(self.at, lambda: self.kill(0))


def windows(records: list[RequestRecord], start: float, end: float, width: float
            ) -> list[dict[str, Any]]:
    """Per window [t, t + width) of arrival time from `start` to `end`: the requests that
    arrived in it, their TTFT p50 and p90 and their cache hit ratio (cached / prompt tokens)."""
    out = []
    t = start
    while t < end - 1e-9:
        inside = [r for r in records if t <= r.arrival < t + width]
        ttfts = [r.ttft_s for r in inside if r.ttft_s is not None]
        prompt = sum(r.prompt_tokens for r in inside)
        out.append({
            "from": t, "to": t + width, "requests": len(inside),
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p90": percentile(ttfts, 0.9),
            "cache_hit": sum(r.cached_tokens for r in inside) / prompt if prompt else None})
        t += width
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="shared-prefix-150x5-6000-1200-1000")
    parser.add_argument("--qps", type=float, default=18.0)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--epps", type=int, default=3, help="EPP replicas before the kill (>= 2)")
    parser.add_argument("--kill-at", type=float, default=30.0, help="virtual seconds")
    parser.add_argument("--window", type=float, default=5.0, help="seconds per window")
    parser.add_argument("--replicas", type=int, default=8, help="engines")
    parser.add_argument("--profile", default="qwen3-32b-2xh100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = parser.parse_args(argv)
    if args.epps < 2:
        parser.error("--epps must be at least 2 (one is killed)")
    if not 0 < args.kill_at < args.duration:
        parser.error("--kill-at must fall inside the arrivals")
    workload = build_workload(PRESETS[args.preset].shape, (args.qps,), args.duration,
                              load_tokenizer(None), arrivals_shape=Arrivals("poisson"))
    profile = get_profile(args.profile)
    n = args.epps
    routers = {f"kvswitch@{n}": MultiEppRouter(DEFAULT_EPP_CONFIG, n, f"kvswitch@{n}",
                                               seed=args.seed),
               f"kvswitch@{n}, one killed": KilledAt(n, args.kill_at, f"kvswitch@{n}-kill",
                                                     args.seed),
               f"kvswitch@{n - 1}": MultiEppRouter(DEFAULT_EPP_CONFIG, n - 1,
                                                   f"kvswitch@{n - 1}", seed=args.seed)}
    results: dict[str, FleetResult] = {}
    for label, router in routers.items():
        results[label] = run_fleet(workload, router, profile, args.replicas, seed=args.seed)
        print(f"{label}: {len(results[label].records)} requests finished, "
              f"{len(results[label].unfinished)} unfinished, {len(results[label].rejected)} "
              "rejected", flush=True)
    start = max(0.0, args.kill_at - 3 * args.window)
    table = {label: windows(r.records, start, args.duration, args.window)
             for label, r in results.items()}
    labels = list(table)
    print(f"\nTTFT p90 (s) / cache hit per window of arrival; EPP replica 0 killed at "
          f"{args.kill_at:g} s")
    print("| arrivals | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for i, w in enumerate(table[labels[0]]):
        cells = []
        for label in labels:
            x = table[label][i]
            cells.append("-" if x["ttft_p90"] is None
                         else f"{x['ttft_p90']:.3f} / {x['cache_hit']:.3f}")
        print(f"| {w['from']:g}-{w['to']:g} s | " + " | ".join(cells) + " |")
    if args.out:
        args.out.write_text(json.dumps({
            "command": "python benchmarks/multi_epp_kill.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "windows": table,
            "overall": {label: r.to_json() for label, r in results.items()}}, indent=1) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
