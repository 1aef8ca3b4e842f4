"""A multi-turn member's later turns: when they were sent, and how many sit in the TTFT tail
(fleet simulator).

For a multi-turn member of `routing_panel.MEMBERS`, replayed as the panel replays it (same seed
and jitter), each router runs in the fleet simulator; per chosen step: its requests, its later
turns (a request whose conversation has an earlier request in the run and still carries its
history), how many of those were sent before the previous turn of the same conversation had
ended under that router (its arrival before the previous turn's arrival + end-to-end latency;
0 while a next turn waits for its previous one, as the workloads' turns do), and how many of
each are at or above the step's TTFT p90. docs/benchmarks/routing-panel/replays.md reads
mt-1000-30 at 20 QPS this way.

    python benchmarks/conversation_turns.py --member mt-1000-30 --step 2 --seed 1 --jitter-ms 1 \\
        --routers round-robin,kvswitch
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_panel import add_step_arguments, replay_steps

from kvswitch.bench.engine_report import percentile
from kvswitch.engine.request_log import RequestRecord


def previous_turns(workload: Any) -> dict[str, str]:
    """Later turn's request id -> the request id of its conversation's previous turn
    (`BenchRequest.previous`), for the turns that still carry their history (a conversation
    that started over is a first turn again)."""
    first_turn = workload.shape.system_prompt_len + workload.shape.question_len
    return {str(r.index): str(r.previous) for r in workload.requests
            if r.previous >= 0 and len(r.prompt_ids) > first_turn}


def tally(records: list[RequestRecord], previous: dict[str, str],
          ended: dict[str, float]) -> dict[str, Any]:
    """One step's requests, its later turns, those sent before their previous turn ended
    (`ended`: request id -> arrival + end-to-end latency, over the whole run; a previous turn
    that never ended counts as not ended), and how many of each are at or above its TTFT p90."""
    p90 = percentile([r.ttft_s for r in records if r.ttft_s is not None], 0.9)
    later = {r.request_id for r in records if r.request_id in previous}
    early = {r.request_id for r in records if r.request_id in later
             and r.arrival < ended.get(previous[r.request_id], float("inf"))}
    slow = {r.request_id for r in records
            if r.ttft_s is not None and p90 is not None and r.ttft_s >= p90}
    return {"requests": len(records), "ttft_p90": p90, "later_turns": len(later),
            "sent_before_previous_ended": len(early), "tail": len(slow),
            "later_in_tail": len(later & slow), "early_in_tail": len(early & slow)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser, routers="round-robin,kvswitch")
    args = parser.parse_args(argv)
    replay = replay_steps(parser, args)
    if not getattr(replay.workload.shape, "multi_turn", False):
        parser.error(f"--member {args.member} is not a multi-turn member")
    previous = previous_turns(replay.workload)
    report = replay.report("conversation_turns.py", argv)
    for name in replay.routers():
        result = replay.run(name)
        ended = {r.request_id: r.arrival + r.e2e_s for r in result.records}
        for stage in replay.stages:
            found = tally(replay.records(result, stage), previous, ended)
            report["steps"].setdefault(str(stage), {})[name] = found
            print(f"step {stage} {name}: TTFT p90 {found['ttft_p90']:.4f} s; "
                  f"{found['requests']} requests, {found['later_turns']} later turns, "
                  f"{found['sent_before_previous_ended']} of them sent before the previous "
                  f"turn ended; in the tail "
                  f"({found['tail']}): {found['later_in_tail']} later turns, "
                  f"{found['early_in_tail']} sent early", flush=True)
    replay.save(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
