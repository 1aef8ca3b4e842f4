"""Where an EPP router's cache misses come from: routed past a holder, lost while queued, or
held nowhere.

For a member of `routing_panel.MEMBERS`, replayed as the panel replays it (same seed and
jitter), `kvswitch up`'s default EPP (or `--epp PATH`) runs in the fleet simulator. When it
routes a request, the most leading prompt tokens any replica holds by its own prefix index, and
those the chosen replica holds, are noted (blocks the engines' KV events reported; the EPP's
speculative entries for requests not yet prefilled do not count). Per QPS step, each request
then counts as:
- `served`: the engine served that many of its tokens from cache (less one block: an engine
  recomputes a fully cached prompt's last token);
- `routed past a holder`: it went to a replica that held fewer (the scorer chose load over
  the cache);
- `lost while queued`: the chosen replica held that many but served fewer: the blocks were
  evicted before the request was scheduled (a waiting request does not pin them, as in vLLM);
- `held nowhere`: no replica held any full block of it.
With the tokens each class left uncached, and how many of its requests were routed while every
replica had requests waiting by the EPP's latest load reports (a saturated pool). Prints a table
per step; `--out` writes JSON.

    python benchmarks/routed_past_cache.py --member sp-1000-6200 --step 2 --seed 1 --jitter-ms 1
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_panel import add_step_arguments, replay_steps

from kvswitch.bench.fleet import EppRouter
from kvswitch.engine.request_log import RequestRecord
from kvswitch.engine.sim.profiles import get_profile
from kvswitch.epp.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvswitch.launcher import DEFAULT_EPP_CONFIG

CLASSES = ("served", "routed past a holder", "lost while queued", "held nowhere")


def classify(record: RequestRecord, held: tuple[int, int], block_size: int) -> str:
    """`held`: the most leading prompt tokens any replica held when the request was routed, and
    those the chosen replica held."""
    most, chosen = held
    if most == 0:
        return "held nowhere"
    if record.cached_tokens >= most - block_size:
        return "served"
    return "lost while queued" if chosen >= most else "routed past a holder"


def held_tokens(index: Any, prompt: Sequence[int], endpoint: str | None = None) -> int:
    """The most leading tokens of `prompt` any endpoint (or `endpoint`) holds by its KV events."""
    hashes = index.block_hashes(prompt)
    best = 0
    for candidate in index.endpoints if endpoint is None else (endpoint,):
        n = 0
        while n < len(hashes) and index.holds_really(candidate, hashes[n]):
            n += 1
        best = max(best, n)
    return best * index.block_size


def tally(records: Sequence[RequestRecord], held: dict[str, tuple[int, int]], block_size: int,
          saturated: set[str]) -> dict[str, Any]:
    """Per class: requests, their prompt tokens not served from cache, and the requests routed
    while the pool was saturated (their ids in `saturated`)."""
    out: dict[str, Any] = {c: {"requests": 0, "uncached_tokens": 0, "saturated": 0}
                           for c in CLASSES}
    for record in records:
        row = out[classify(record, held[record.request_id], block_size)]
        row["requests"] += 1
        row["uncached_tokens"] += record.prompt_tokens - record.cached_tokens
        row["saturated"] += record.request_id in saturated
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser)
    parser.add_argument("--epp", type=Path, default=None,
                        help="EndpointPickerConfig with a precise-prefix-cache-scorer, whose "
                             "index is read (default: kvswitch up's)")
    args = parser.parse_args(argv)
    replay = replay_steps(parser, args)
    router = EppRouter(args.epp if args.epp is not None else DEFAULT_EPP_CONFIG, "kvswitch",
                       seed=args.seed)
    held: dict[str, tuple[int, int]] = {}
    saturated: set[str] = set()
    route = router.route

    def noting(request: Any, now: float) -> int | None:
        index = next(p.index for p in router.router.scheduler.plugins
                     if isinstance(p, PrecisePrefixCacheScorer))
        most = held_tokens(index, request.prompt_ids)
        if all(e.metrics.waiting for e in router.router.datalayer.ready()):
            saturated.add(str(request.index))
        pick = route(request, now)
        chosen = held_tokens(index, request.prompt_ids, router.addresses[pick]) \
            if pick is not None else 0
        held[str(request.index)] = (most, chosen)
        return pick

    router.route = noting  # type: ignore[method-assign]
    result = replay.run(router)
    block_size = get_profile(replay.member.profile).block_size
    steps = {str(stage): tally(replay.records(result, stage), held, block_size, saturated)
             for stage in replay.stages}
    for step, rows in steps.items():
        print(f"## {args.member}, step {step}\n")
        print("| class | requests | uncached tokens | routed with every replica queuing |\n"
              "|---|---|---|---|")
        for c in CLASSES:
            print(f"| {c} | {rows[c]['requests']} | {rows[c]['uncached_tokens']:,} "
                  f"| {rows[c]['saturated']} |")
        print()
    replay.save({**replay.report("routed_past_cache.py", argv), "steps": steps})
    if args.out is not None:
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
