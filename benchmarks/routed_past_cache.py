"""Where an EPP router's cache misses come from: routed past a holder, or held nowhere.

For a member of `routing_panel.MEMBERS`, replayed as the panel replays it (same seed and
jitter), `kvswitch up`'s default EPP (or `--epp PATH`) runs in the fleet simulator. When it
routes a request, the most leading prompt tokens any replica holds by its own prefix index are
noted (blocks the engines' KV events reported; the EPP's speculative entries for requests not
yet prefilled do not count). Per QPS step, each request then counts as:
- `served`: the engine served that many of its tokens from cache (less one block: an engine
  recomputes a fully cached prompt's last token);
- `routed past a holder`: it went to a replica that served fewer (the scorer chose load over
  the cache);
- `held nowhere`: no replica held any full block of it.
With the tokens each class left uncached. Prints a table per step; `--out` writes JSON.

    python benchmarks/routed_past_cache.py --member sp-1000-6200 --step 2 --seed 1 --jitter-ms 1
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_panel import add_step_arguments, replay_steps

from kvswitch.bench.fleet import EppRouter, run_fleet
from kvswitch.engine.request_log import RequestRecord
from kvswitch.engine.sim.profiles import get_profile
from kvswitch.epp.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvswitch.launcher import DEFAULT_EPP_CONFIG

CLASSES = ("served", "routed past a holder", "held nowhere")


def classify(record: RequestRecord, held_tokens: int, block_size: int) -> str:
    """`held_tokens`: the most leading prompt tokens a replica held when the request was routed."""
    if held_tokens == 0:
        return "held nowhere"
    served = record.cached_tokens >= held_tokens - block_size
    return "served" if served else "routed past a holder"


def held_tokens(index: Any, prompt: Sequence[int]) -> int:
    """The most leading tokens of `prompt` any endpoint holds by its KV events."""
    hashes = index.block_hashes(prompt)
    best = 0
    for endpoint in index.endpoints:
        n = 0
        while n < len(hashes) and index.holds_really(endpoint, hashes[n]):
            n += 1
        best = max(best, n)
    return best * index.block_size


def tally(records: Sequence[RequestRecord], held: dict[str, int], block_size: int
          ) -> dict[str, Any]:
    """Per class: requests, and their prompt tokens not served from cache."""
    out: dict[str, Any] = {c: {"requests": 0, "uncached_tokens": 0} for c in CLASSES}
    for record in records:
        row = out[classify(record, held[record.request_id], block_size)]
        row["requests"] += 1
        row["uncached_tokens"] += record.prompt_tokens - record.cached_tokens
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser)
    parser.add_argument("--epp", type=Path, default=None,
                        help="EndpointPickerConfig with a precise-prefix-cache-scorer, whose "
                             "index is read (default: kvswitch up's)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = parser.parse_args(argv)
    replay = replay_steps(parser, args)
    member, workload = replay.member, replay.workload
    router = EppRouter(args.epp if args.epp is not None else DEFAULT_EPP_CONFIG, "kvswitch",
                       seed=args.seed)
    held: dict[str, int] = {}
    route = router.route

    def noting(request: Any, now: float) -> int | None:
        index = next(p.index for p in router.router.scheduler.plugins
                     if isinstance(p, PrecisePrefixCacheScorer))
        held[str(request.index)] = held_tokens(index, request.prompt_ids)
        return route(request, now)

    router.route = noting  # type: ignore[method-assign]
    profile = get_profile(member.profile)
    result = run_fleet(workload, router, profile, args.replicas, seed=args.seed)
    steps = {str(stage): tally([r for r in result.records
                                if replay.stage_of[r.request_id] == stage],
                               held, profile.block_size)
             for stage in replay.stages}
    for step, rows in steps.items():
        print(f"## {args.member}, step {step}\n")
        print("| class | requests | uncached tokens |\n|---|---|---|")
        for c in CLASSES:
            print(f"| {c} | {rows[c]['requests']} | {rows[c]['uncached_tokens']:,} |")
        print()
    if args.out:
        args.out.write_text(json.dumps({
            "command": "python benchmarks/routed_past_cache.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "member": args.member, "steps": steps}, indent=1) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
