"""How far each router spreads a shared-prefix group over the replicas, per step (fleet simulator).

For a preset member of `routing_panel.MEMBERS` (its requests carry a group: the system prompt
they share), replayed as the panel replays it (same seed and jitter), each router runs in the
fleet simulator. Per chosen step and router, over the groups with at least two requests in the
step: the mean number of replicas a group's requests went to, how many groups went to 1, 2, 3
or more, and the mean share of a group's requests on its most used replica. Beside them, the
step's TTFT p90. A group kept on one replica shares its prefix's KV blocks there; spread, each
replica holding it keeps a copy. docs/benchmarks/routing-panel/default.md reads sp-1000-6200 at
20 QPS this way.

    python benchmarks/group_spread.py --member sp-1000-6200 --step 0 1 2 --seed 1 --jitter-ms 1 \\
        --routers smg-cache-aware-model,kvswitch,round-robin
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_panel import add_step_arguments, replay_steps

from kvswitch.bench.engine_report import percentile


def spread(groups: dict[int, list[int]]) -> dict[str, Any]:
    """Per group, the replicas its requests went to (group -> one replica per request)."""
    counted = [Counter(replicas) for replicas in groups.values() if len(replicas) >= 2]
    if not counted:
        return {"groups": 0, "replicas_per_group": 0.0, "groups_on": {},
                "top_replica_share": 0.0}
    on = Counter(min(len(c), 4) for c in counted)
    return {"groups": len(counted),
            "replicas_per_group": statistics.fmean(len(c) for c in counted),
            "groups_on": {("4+" if k == 4 else str(k)): on[k] for k in sorted(on)},
            "top_replica_share": statistics.fmean(max(c.values()) / sum(c.values())
                                                  for c in counted)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser, routers="smg-cache-aware-model,kvswitch")
    args = parser.parse_args(argv)
    replay = replay_steps(parser, args)
    group_of = {str(r.index): r.group for r in replay.workload.requests}
    report = replay.report("group_spread.py", argv)
    for name in replay.routers():
        result = replay.run(name)
        for stage in replay.stages:
            records = replay.records(result, stage)
            groups: dict[int, list[int]] = defaultdict(list)
            for record in records:
                groups[group_of[record.request_id]].append(result.replica_of[record.request_id])
            found = {"ttft_p90": percentile([r.ttft_s for r in records
                                             if r.ttft_s is not None], 0.9),
                     **spread(groups)}
            report["steps"].setdefault(str(stage), {})[name] = found
            print(f"step {stage} {name}: TTFT p90 {found['ttft_p90']:.3f} s; "
                  f"{found['groups']} groups on {found['replicas_per_group']:.2f} replicas each "
                  f"(by count {found['groups_on']}), {found['top_replica_share']:.2f} of a "
                  f"group's requests on its most used replica", flush=True)
    replay.save(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
