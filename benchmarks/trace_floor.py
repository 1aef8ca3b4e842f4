"""The TTFT floor of a trace slice: what no router can beat, from the simulator's step model.

Per replayed row (the same rows `kvswitch.bench.trace.load_trace` replays: start <= timestamp <
start + duration, rows too long for the profile left out), the time to first token if the
request ran alone on an idle replica: its uncached prompt prefilled in chunks of the profile's
`max_num_batched_tokens`, each chunk one step of `SimProfile.step_seconds` (no decode, the
chunk's attention over the KV before it). Two floors: with nothing cached, and with an ideal
cache shared by every request (the leading 512-token blocks an earlier row of the slice held,
at most input_length - 1 tokens, as `ideal_hit_ratio` counts them). Prints and saves the p50 and
p90 of each per slice; the p90 is what the routing panel's TTFT p90 should be read against.

    python benchmarks/trace_floor.py benchmarks/traces/mooncake_synthetic.jsonl --starts 0,400,800
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvswitch.bench.engine_report import percentile
from kvswitch.bench.trace import TRACE_BLOCK, TraceRow, read_mooncake
from kvswitch.engine.sim.profiles import SimProfile, get_profile


def alone_seconds(profile: SimProfile, prompt: int, cached: int = 0) -> float:
    """TTFT of a `prompt`-token request with `cached` tokens already in KV, alone on a replica."""
    chunk, done, seconds = profile.max_num_batched_tokens, cached, 0.0
    while done < prompt:
        n = min(chunk, prompt - done)
        seconds += profile.step_seconds(n, 0, prefill_context=done + n,
                                        prefill_pairs=n * done + n * (n + 1) // 2)
        done += n
    return seconds


def floors(rows: list[TraceRow], profile: SimProfile, start: float, duration: float
           ) -> dict[str, Any]:
    replayed = [r for r in rows if start <= r.timestamp < start + duration
                and r.input_length + r.output_length <= profile.max_model_len]
    seen: set[int] = set()
    cold, warm = [], []
    for row in replayed:
        held = 0
        for block in row.hash_ids:
            if block not in seen:
                break
            held += 1
        cold.append(alone_seconds(profile, row.input_length))
        warm.append(alone_seconds(profile, row.input_length,
                                  min(held * TRACE_BLOCK, row.input_length - 1)))
        seen.update(row.hash_ids)
    return {"start": start, "duration": duration, "rows": len(replayed),
            "no_cache": _quantiles(cold), "ideal_cache": _quantiles(warm)}


def _quantiles(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 0.5), "p90": percentile(values, 0.9)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="Mooncake JSONL trace")
    parser.add_argument("--starts", default="0", help="slice starts, seconds, comma-separated")
    parser.add_argument("--duration", type=float, default=180.0, help="slice length, seconds")
    parser.add_argument("--profile", default="qwen3-32b-2xh100-128k")
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = parser.parse_args(argv)
    profile = get_profile(args.profile)
    rows = read_mooncake(args.trace)
    slices = [floors(rows, profile, float(s), args.duration) for s in args.starts.split(",")]
    for f in slices:
        cold, warm = f["no_cache"], f["ideal_cache"]
        print(f"{f['start']:g}-{f['start'] + f['duration']:g} s, {f['rows']} rows: TTFT p90 alone "
              f"{cold['p90']:.2f} s with nothing cached, {warm['p90']:.2f} s with an ideal cache"
              if f["rows"] else f"{f['start']:g} s: no rows")
    if args.out:
        args.out.write_text(json.dumps({
            "command": "python benchmarks/trace_floor.py " + " ".join(sys.argv[1:] if argv is None
                                                                      else argv),
            "trace": args.trace.name, "profile": args.profile, "slices": slices}, indent=1) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
