"""Several EPPs at the saturation edge: how many replicas each prefix group lands on, and what
one prefix index shared by the EPPs would change (fleet simulator, virtual time).

Routers: `kvswitch` (one EPP, `kvswitch up`'s default config), `kvswitch@N` (N EPPs, each with
its own prefix index, speculative entries and in-flight counts: what `kvswitch up
--epp-replicas N` runs), and `shared@N`: the same N EPPs whose precise-prefix-cache scorers all
read and write one `KvBlockIndex`, so a request one EPP routes marks its blocks (speculative
entries, pending prefill) for all of them. `shared@N` is not something kvswitch can run (its
replicas share nothing but the engines' KV-event streams); it bounds what sharing those entries
would buy. `pending@N`: N EPPs with their own indexes whose estimated-ttft scorers count every
EPP's prefill in progress (`pending_prefill` summed over the EPPs), not only their own: it
tells the two shared parts apart.

Per router: TTFT p50/p90, engine cache hit, and how many distinct replicas served each prefix
group (a group = the requests whose prompts share their first 64 tokens, the system prompt).
Prints a line per router and writes JSON (`--out`). `--qps 6,12,18,24,30` runs those rates as
the steps of one ladder, as `python -m kvswitch.bench.fleet` does: each router's result then
also lists every step (`steps`; the top-level figures are the first step's).

    python benchmarks/multi_epp_scatter.py --qps 24 --seed 0 \
        --routers kvswitch,kvswitch@3,shared@3 --out benchmarks/results/multi_epp_scatter_seed0.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvswitch.bench.fleet import make_router, run_fleet
from kvswitch.bench.fleet.multi_epp import MultiEppRouter
from kvswitch.bench.fleet.routers import FleetContext
from kvswitch.bench.workloads import PRESETS, Arrivals, build_workload
from kvswitch.engine.sim.profiles import get_profile
from kvswitch.epp.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvswitch.launcher import DEFAULT_EPP_CONFIG
from kvswitch.tokenization import load_tokenizer

GROUP_TOKENS = 64


class SharedIndexRouter(MultiEppRouter):
    """N EPPs over one prefix index: the first EPP's subscribers feed it, every EPP reads it
    and adds its speculative entries to it; each keeps its own data layer and counts."""

    def setup(self, ctx: FleetContext) -> None:
        super().setup(ctx)
        shared = next(p for p in self.epps[0].router.scheduler.plugins
                      if isinstance(p, PrecisePrefixCacheScorer))
        for epp in self.epps[1:]:
            for plugin in epp.router.scheduler.plugins:
                if isinstance(plugin, PrecisePrefixCacheScorer):
                    plugin.index = shared.index
                    plugin._pending = shared.index.pending
            # Load records still reach every EPP's data layer (the streams' on_load).
            for subscribers in epp.subscribers:
                for subscriber in subscribers.values():
                    subscriber.index = _NoIndex()  # type: ignore[assignment]


class SharedPendingRouter(MultiEppRouter):
    """N EPPs, each with its own index (own speculative entries), whose estimated-ttft inputs
    count every EPP's prefill in progress (the sum of their `pending_prefill`)."""

    def setup(self, ctx: FleetContext) -> None:
        super().setup(ctx)
        scorers = [p for epp in self.epps for p in epp.router.scheduler.plugins
                   if isinstance(p, PrecisePrefixCacheScorer)]
        summed = _SummedPending([p.index.pending for p in scorers])
        for scorer in scorers:
            scorer._pending = summed  # type: ignore[assignment]


class _SummedPending(Mapping[str, int]):
    def __init__(self, parts: list[dict[str, int]]) -> None:
        self.parts = parts

    def __getitem__(self, address: str) -> int:
        if not any(address in part for part in self.parts):
            raise KeyError(address)
        return sum(part.get(address, 0) for part in self.parts)

    def __iter__(self) -> Iterator[str]:
        return iter({a for part in self.parts for a in part})

    def __len__(self) -> int:
        return len({a for part in self.parts for a in part})


class _NoIndex:
    """Where the other EPPs' subscribers apply their events: nowhere (the first EPP's feed the
    shared index)."""

    def apply(self, endpoint: str, events: Any) -> None:
        pass

    def clear(self, endpoint: str) -> None:
        pass


def router(name: str, seed: int) -> Any:
    if name.startswith("shared@"):
        return SharedIndexRouter(DEFAULT_EPP_CONFIG, int(name.split("@")[1]), name=name,
                                 seed=seed)
    if name.startswith("pending@"):
        return SharedPendingRouter(DEFAULT_EPP_CONFIG, int(name.split("@")[1]), name=name,
                                   seed=seed)
    return make_router(name, seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="shared-prefix-150x5-6000-1200-1000",
                        choices=sorted(PRESETS))
    parser.add_argument("--qps", default="24", help="a rate, or comma-separated rates (a ladder)")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routers", default="kvswitch,kvswitch@2,kvswitch@3,shared@2,shared@3")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    rates = tuple(float(q) for q in args.qps.split(","))
    workload = build_workload(preset.shape, rates, preset.stage_duration,
                              load_tokenizer(None), seed=args.seed,
                              arrivals_shape=Arrivals("poisson"))
    profile = get_profile("qwen3-32b-2xh100")
    results: dict[str, Any] = {}
    for name in args.routers.split(","):
        result = run_fleet(workload, router(name, args.seed), profile, args.replicas,
                           seed=args.seed)
        groups: dict[tuple[int, ...], set[int]] = collections.defaultdict(set)
        for request in workload.requests:
            replica = result.replica_of.get(str(request.index))
            if replica is not None:
                groups[tuple(request.prompt_ids[:GROUP_TOKENS])].add(replica)
        spread = collections.Counter(len(replicas) for replicas in groups.values())
        step = result.steps[0]
        results[name] = {
            "ttft_p50": step["ttft_p50"], "ttft_p90": step["ttft_p90"],
            "ttft_p99": step["ttft_p99"], "cache_hit_rate": step["cache_hit_rate"],
            "groups": len(groups),
            "groups_by_replica_count": {str(k): v for k, v in sorted(spread.items())},
            "replicas_per_group": sum(len(r) for r in groups.values()) / len(groups)}
        if len(rates) > 1:
            results[name]["steps"] = [
                {"qps": s["qps"], "ttft_p50": s["ttft_p50"], "ttft_p90": s["ttft_p90"],
                 "ttft_p99": s["ttft_p99"], "cache_hit_rate": s["cache_hit_rate"]}
                for s in result.steps]
        for s in result.steps:
            print(f"{name:12} qps {s['qps']:g} seed {args.seed}  TTFT p50 {s['ttft_p50']:.3f} "
                  f"p90 {s['ttft_p90']:.3f}  hit {s['cache_hit_rate']:.3f}", flush=True)
        print(f"{name:12} groups on 1/2/3+ replicas {spread[1]}/{spread[2]}/"
              f"{sum(v for k, v in spread.items() if k > 2)}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"qps": rates[0] if len(rates) == 1 else list(rates),
                                        "seed": args.seed,
                                        "preset": args.preset, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
