"""How full each replica was during one routing-panel step, per router (fleet simulator).

For a member of `routing_panel.MEMBERS`, replayed as the panel replays it (same seed and
jitter), each router runs in the fleet simulator; over the step's arrival window [first, last
arrival] every replica's running requests (a step's batch), waiting requests and KV-cache
blocks in use are averaged over time: each scheduler step weighs its state at its start by its
duration within the window, and an idle replica counts as empty. Beside them, the step's TTFT p90,
its prefix cache hit rate (cached / prompt tokens of the step's requests) and its preemptions. When
the KV cache is the bound, a router whose requests share more blocks runs more of them at once:
docs/benchmarks/routing-panel/replays.md reads sp-1000-6200 at 20 QPS this way.

    python benchmarks/step_occupancy.py --member sp-1000-6200 --step 2 --seed 1 --jitter-ms 1 \\
        --routers smg-cache-aware-model,kvswitch
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_panel import add_step_arguments, replay_steps

from kvswitch.bench.engine_report import percentile
from kvswitch.bench.fleet.replica import Replica
from kvswitch.engine.sim.scheduler import StepResult


class Occupancy:
    """Time-weighted per-replica state over [start, end] (an `on_step` hook of `run_fleet`)."""

    def __init__(self, replicas: int, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.sums = [[0.0, 0.0, 0.0] for _ in range(replicas)]

    def __call__(self, replica: Replica, at: float, step: StepResult) -> None:
        weight = min(at + step.duration, self.end) - max(at, self.start)
        if weight <= 0:
            return
        blocks = replica.profile.num_gpu_blocks
        sums = self.sums[replica.index]
        sums[0] += weight * step.scheduled
        sums[1] += weight * len(replica.scheduler.waiting)
        sums[2] += weight * replica.kv.pool.num_used / blocks

    def means(self) -> list[dict[str, float]]:
        span = max(self.end - self.start, 1e-9)
        return [{"running": s[0] / span, "waiting": s[1] / span, "kv_usage": s[2] / span}
                for s in self.sums]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser, routers="smg-cache-aware-model,kvswitch")
    args = parser.parse_args(argv)
    replay = replay_steps(parser, args)
    report = replay.report("step_occupancy.py", argv)
    windows = {}
    for stage in replay.stages:
        sent = [r.send_at for r in replay.workload.requests if r.stage == stage]
        windows[stage] = (min(sent), max(sent))
    for name in replay.routers():
        # One run per router; each chosen step's window samples the same run.
        occupancies = {stage: Occupancy(args.replicas, *window)
                       for stage, window in windows.items()}

        def on_step(replica: Replica, at: float, step: StepResult,
                    occupancies: dict[int, Occupancy] = occupancies) -> None:
            for occupancy in occupancies.values():
                occupancy(replica, at, step)

        result = replay.run(name, on_step=on_step)
        for stage, occupancy in occupancies.items():
            records = replay.records(result, stage)
            per_replica = occupancy.means()
            found = {
                "ttft_p90": percentile([r.ttft_s for r in records if r.ttft_s is not None], 0.9),
                "cache_hit_rate": sum(r.cached_tokens for r in records)
                / max(1, sum(r.prompt_tokens for r in records)),
                "preemptions": sum(r.preemptions for r in records),
                "running_mean": sum(p["running"] for p in per_replica) / len(per_replica),
                "per_replica": per_replica}
            report["steps"].setdefault(str(stage), {})[name] = found
            cells = "  ".join(f"{p['running']:.1f}/{p['waiting']:.1f}/{p['kv_usage']:.2f}"
                              for p in per_replica)
            print(f"step {stage} {name}: TTFT p90 {found['ttft_p90']:.3f} s, hit "
                  f"{found['cache_hit_rate']:.3f}, {found['preemptions']} preemptions, "
                  f"{found['running_mean']:.1f} running per replica; per replica "
                  f"running/waiting/KV: {cells}", flush=True)
    replay.save(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
