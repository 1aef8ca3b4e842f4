"""Routing quality as the engines measured it: summaries of their request logs.

Every target (kvswitch, round robin, SMG, the oracle) sends to the same engines, and each engine
logs every request it served on its own clock (`kvswitch engine --request-log`). So these numbers
do not depend on the client, the gateway's transport, or how loaded the machine is; they are the
headline of a report, with the client's own measurements beside them.

- Steps: a record belongs to the QPS step whose wall-clock window holds its arrival at the
  engine, window k = [start + k x D / X, start + (k + 1) x D / X) for steps of D simulated
  seconds at time scale X (arrivals after the last window belong to the last step).
- Common timeline: engines' clocks have different origins, so a record's arrival is placed at
  (arrival_wall - start) x X simulated seconds and its finish at that + e2e_s.
- Output tok/s, inference-perf's definition per stage: output tokens of the stage's successful
  requests / (latest finish - earliest arrival) over all of the stage's requests.
- TTFT, queue, mean ITL and e2e percentiles are over the step's successful requests; cache hit =
  cached / prompt tokens.
- Clock slip: the simulator moves its clock's anchor when Python falls behind, dropping
  simulated time. Between an engine's first and last arrival of the run,
  slip = (wall_last - wall_first) x X - (arrival_last - arrival_first); fraction = slip over
  the simulated span. Near 0: the engine kept up with the time scale. Per step, the largest
  fraction over the engines of the slip within that step's window (is a saturated step the one
  that slipped?).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvswitch.engine.request_log import RequestRecord

SUCCESS = ("stop", "length")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def bucket(records: Iterable[RequestRecord], start_wall: float, step_wall: float,
           steps: int) -> list[list[RequestRecord]]:
    """Records per step by wall arrival; arrivals before `start_wall` are dropped."""
    out: list[list[RequestRecord]] = [[] for _ in range(steps)]
    for r in records:
        if r.arrival_wall >= start_wall and steps:
            out[min(int((r.arrival_wall - start_wall) / step_wall), steps - 1)].append(r)
    return out


def output_tok_s(records: Sequence[RequestRecord], start_wall: float,
                 time_scale: float) -> float | None:
    """Output tokens of the successful requests / (latest finish - earliest arrival)."""
    if not records:
        return None
    arrivals = [(r.arrival_wall - start_wall) * time_scale for r in records]
    span = max(a + r.e2e_s for a, r in zip(arrivals, records, strict=True)) - min(arrivals)
    tokens = sum(r.completion_tokens for r in records if r.finish_reason in SUCCESS)
    return tokens / span if span > 0 else None


def step_summary(records: Sequence[RequestRecord], start_wall: float,
                 time_scale: float) -> dict[str, Any]:
    ok = [r for r in records if r.finish_reason in SUCCESS]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    queue = [r.queue_s for r in ok if r.queue_s is not None]
    itl = [r.itl_s for r in ok if r.itl_s is not None]
    e2e = [r.e2e_s for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    preemptions = [r.preemptions for r in records if r.preemptions is not None]
    return {
        "requests": len(records), "succeeded": len(ok),
        "ttft_p50": percentile(ttft, 0.5), "ttft_p90": percentile(ttft, 0.9),
        "ttft_p99": percentile(ttft, 0.99), "ttft_mean": sum(ttft) / len(ttft) if ttft else None,
        "queue_p50": percentile(queue, 0.5), "queue_p90": percentile(queue, 0.9),
        "itl_p50": percentile(itl, 0.5), "itl_p90": percentile(itl, 0.9),
        "e2e_p50": percentile(e2e, 0.5), "e2e_p90": percentile(e2e, 0.9),
        "output_tok_s": output_tok_s(records, start_wall, time_scale),
        "cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        "preemptions": sum(preemptions) if preemptions else None,
    }


def clock_slip(records: Sequence[RequestRecord], time_scale: float) -> dict[str, float] | None:
    """One engine's clock slip over its records (module docstring); None with < 2 records."""
    if len(records) < 2:
        return None
    first = min(records, key=lambda r: r.arrival_wall)
    last = max(records, key=lambda r: r.arrival_wall)
    span = (last.arrival_wall - first.arrival_wall) * time_scale
    slip = span - (last.arrival - first.arrival)
    return {"slip_s": slip, "span_s": span, "slip_fraction": slip / span if span > 0 else 0.0}


def engine_summary(by_engine: Mapping[str, Sequence[RequestRecord]], start_wall: float,
                   time_scale: float, stage_duration: float, qps: Sequence[float]
                   ) -> dict[str, Any]:
    """Per step, overall and per engine (records, clock slip) for one target's run."""
    step_wall = stage_duration / time_scale
    records = [r for rs in by_engine.values() for r in rs]
    steps = bucket(records, start_wall, step_wall, len(qps))
    slips = {a: clock_slip(rs, time_scale) for a, rs in by_engine.items()}
    known = [s for s in slips.values() if s is not None]
    step_slips: list[list[float]] = [[] for _ in qps]
    for rs in by_engine.values():
        for i, in_step in enumerate(bucket(rs, start_wall, step_wall, len(qps))):
            slip = clock_slip(in_step, time_scale)
            if slip is not None:
                step_slips[i].append(slip["slip_fraction"])
    return {
        "steps": [{"qps": rate, **step_summary(rs, start_wall, time_scale),
                   "clock_slip_max_fraction": max(slip, default=None)}
                  for rate, rs, slip in zip(qps, steps, step_slips, strict=True)],
        "overall": step_summary([r for rs in steps for r in rs], start_wall, time_scale),
        "requests_per_engine": {a: len(rs) for a, rs in by_engine.items()},
        "clock_slip": slips,
        "clock_slip_max_s": max((s["slip_s"] for s in known), default=None),
        "clock_slip_max_fraction": max((s["slip_fraction"] for s in known), default=None),
    }
