"""What the slowest requests of one routing-panel step were, per router (fleet simulator).

For a member of `routing_panel.MEMBERS`, replayed as the panel replays it (same seed and
jitter), each router runs in the fleet simulator; of the requests sent in each `--step`, those
whose TTFT is at or above the step's TTFT p90 are tallied by (prompt tokens, uncached tokens),
each rounded to 100: how many, their TTFT range and mean queue time; the JSON also counts all
the step's requests per kind. A p90 gap between two routers then reads as the kinds of request
that fill one router's tail and not the other's (docs/benchmarks/routing-panel/replays.md uses
it on mt-1000-3000 at 15 QPS). Prints a table per router and step; `--out` writes JSON.

    python benchmarks/ttft_tail.py --member mt-1000-3000 --step 0 2 --seed 1 --jitter-ms 1 \\
        --routers round-robin,kvswitch,oracle
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_panel import add_step_arguments, replay_steps

from kvswitch.bench.engine_report import percentile
from kvswitch.engine.request_log import RequestRecord


def kind(record: RequestRecord) -> tuple[int, int]:
    """(prompt tokens, uncached prompt tokens), each rounded to 100."""
    return (round(record.prompt_tokens, -2), round(record.prompt_tokens - record.cached_tokens, -2))


def tail(records: list[RequestRecord]) -> dict[str, Any]:
    """The step's TTFT p90 and its tail (TTFT >= p90) by kind, beside the step's kinds."""
    timed = [r for r in records if r.ttft_s is not None]
    p90 = percentile([r.ttft_s for r in timed if r.ttft_s is not None], 0.9)
    slow = [r for r in timed if p90 is not None and r.ttft_s is not None and r.ttft_s >= p90]
    every = Counter(kind(r) for r in timed)
    rows = []
    for (prompt, uncached), n in Counter(kind(r) for r in slow).most_common():
        group = [r for r in slow if kind(r) == (prompt, uncached)]
        ttfts = [r.ttft_s for r in group if r.ttft_s is not None]
        rows.append({"prompt": prompt, "uncached": uncached, "in_tail": n,
                     "in_step": every[(prompt, uncached)],
                     "ttft_min": min(ttfts), "ttft_max": max(ttfts),
                     "queue_mean": sum(r.queue_s or 0.0 for r in group) / n})
    step = [{"prompt": prompt, "uncached": uncached, "count": n}
            for (prompt, uncached), n in sorted(every.items())]
    return {"requests": len(timed), "ttft_p90": p90, "tail": len(slow), "kinds": rows,
            "step_kinds": step}


def markdown(router: str, result: dict[str, Any]) -> str:
    title = (f"## {router}: {result['tail']} of {result['requests']} requests at or above the "
             f"TTFT p90 ({result['ttft_p90']:.3f} s)")
    lines = [title, "",
             "| prompt | uncached | in tail | in step | TTFT (s) | mean queue (s) |",
             "|---|---|---|---|---|---|"]
    for k in result["kinds"]:
        lines.append(f"| {k['prompt']} | {k['uncached']} | {k['in_tail']} | {k['in_step']} | "
                     f"{k['ttft_min']:.3f}-{k['ttft_max']:.3f} | {k['queue_mean']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser, routers="round-robin,kvswitch")
    args = parser.parse_args(argv)
    replay = replay_steps(parser, args)
    report = replay.report("ttft_tail.py", argv)
    for name in replay.routers():
        result = replay.run(name)
        for stage in replay.stages:
            found = tail(replay.records(result, stage))
            report["steps"].setdefault(str(stage), {})[name] = found
            print(markdown(f"{name}, step {stage}", found), flush=True)
    replay.save(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
