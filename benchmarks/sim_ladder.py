"""llm-d's precise-prefix ladder in the virtual-time fleet simulator, against llm-d's figures.

The workload is llm-d's (kvswitch's `shared-prefix-150x5-6000-1200-1000` shape at llm-d's QPS
3, 10, 15, 20, 22, 25, 30, 40, 50, 60 x 50 s) on 8 x `qwen3-32b-2xh100`. inference-perf runs a
stage until every request it sent has finished, then starts the next, so the caches stay warm
and no queue crosses a stage: here stage k's arrivals are shifted by k x `GAP` virtual seconds,
which is longer than any stage takes to drain. A stage's output tok/s is its output tokens over
its span (first send to last finish), as inference-perf measures a stage; the ladder's is all
tokens over the summed spans. TTFT is engine-side (the fleet's records).

Used by benchmarks/sim_calibration.py; alone:

    .venv/bin/python benchmarks/sim_ladder.py --router round-robin --step-model roofline
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from kvswitch.bench.engine_report import percentile
from kvswitch.bench.fleet import make_router, run_fleet
from kvswitch.bench.workloads import SharedPrefixShape, build_workload
from kvswitch.engine.sim.profiles import get_profile
from kvswitch.tokenization import load_tokenizer

QPS = (3, 10, 15, 20, 22, 25, 30, 40, 50, 60)
STAGE_SECONDS = 50.0
GAP = 1200.0
"""Virtual seconds between stage starts beyond the stage itself (a stage drains within it)."""
REPLICAS = 8
PROFILE = "qwen3-32b-2xh100"
ROUTERS = {"round-robin": "round robin", "kvswitch": "precise prefix"}

PUBLISHED = {
    # llm-d/llm-d guides/precise-prefix-cache-aware/README.md, "Summary across the full ladder"
    # and the rate=60 stage (k8s Service round robin vs llm-d precise).
    "round robin": {"output_tok_s": 5722, "ttft_p90": 107.43, "itl_mean_ms": 44.0,
                    "rate60_output_tok_s": 6551, "rate60_ttft_p90": 138.66},
    "precise prefix": {"output_tok_s": 12598, "ttft_p90": 0.262, "itl_mean_ms": 47.0,
                       "rate60_output_tok_s": 16620, "rate60_ttft_p90": 1.174},
}
SOURCES = {
    "output_tok_s / ttft_p90": "issue 25's table (llm-d's published ladder: round robin 5,722 "
    "tok/s, 107 s; precise 12,598 tok/s, 0.262 s); one revision of llm-d's guide README gives "
    "12,931 tok/s and 1.060 s for precise, the blog post 8,730 tok/s and 0.542 s",
    "itl_mean_ms, rate60_*": "llm-d/llm-d guides/precise-prefix-cache-aware/README.md, "
    "Benchmarking Report (rate=60 stage and ladder summary)",
}


def ladder_workload(seed: int = 0) -> Any:
    """llm-d's ladder with stage k's sends shifted by k x GAP."""
    shape = SharedPrefixShape(150, 5, 6000, 1200, 1000)
    workload = build_workload(shape, QPS, STAGE_SECONDS, load_tokenizer(None), seed=seed)
    shifted = tuple(dataclasses.replace(r, send_at=r.send_at + r.stage * GAP)
                    for r in workload.requests)
    return dataclasses.replace(workload, requests=shifted)


def run_ladder(router: str, step_model: str, workload: Any) -> dict[str, Any]:
    profile = get_profile(PROFILE, step_model)
    result = run_fleet(workload, make_router(router), profile, REPLICAS, drain_limit=GAP)
    stage_of = {str(r.index): r.stage for r in workload.requests}
    stages: list[dict[str, Any]] = []
    all_ttft: list[float] = []
    tokens_total = span_total = 0.0
    for k, qps in enumerate(QPS):
        records = [r for r in result.records if stage_of[r.request_id] == k]
        start = k * (STAGE_SECONDS + GAP)
        end = max((r.arrival + r.e2e_s for r in records), default=start)
        tokens = sum(r.completion_tokens for r in records)
        ttft = [r.ttft_s for r in records if r.ttft_s is not None]
        itl = [r.itl_s for r in records if r.itl_s is not None]
        all_ttft += ttft
        tokens_total += tokens
        span_total += end - start
        stages.append({
            "qps": qps, "requests": len(records), "output_tok_s": round(tokens / (end - start)),
            "ttft_p90": percentile(ttft, 0.9), "ttft_mean": sum(ttft) / len(ttft) if ttft else None,
            "itl_mean_ms": 1e3 * sum(itl) / len(itl) if itl else None,
            "span_s": round(end - start, 1),
            "cache_hit_rate": round(sum(r.cached_tokens for r in records)
                                    / max(1, sum(r.prompt_tokens for r in records)), 3),
            "preemptions": sum(r.preemptions or 0 for r in records)})
    itl_all = [r.itl_s for r in result.records if r.itl_s is not None]
    return {
        "router": router, "step_model": step_model,
        "output_tok_s": round(tokens_total / span_total) if span_total else 0,
        "ttft_p90": percentile(all_ttft, 0.9),
        "itl_mean_ms": 1e3 * sum(itl_all) / len(itl_all) if itl_all else None,
        "unfinished": len(result.unfinished), "stages": stages,
        "wall_seconds": round(result.wall_seconds, 1)}


def compare(run: dict[str, Any]) -> dict[str, Any]:
    published = PUBLISHED[ROUTERS[run["router"]]]
    rate60 = run["stages"][-1]
    return {
        "output_tok_s_error": round(run["output_tok_s"] / published["output_tok_s"] - 1, 3),
        "ttft_p90_ratio": round(run["ttft_p90"] / published["ttft_p90"], 2)
        if run["ttft_p90"] else None,
        "rate60_output_tok_s_error": round(rate60["output_tok_s"]
                                           / published["rate60_output_tok_s"] - 1, 3),
        "rate60_ttft_p90_ratio": round(rate60["ttft_p90"] / published["rate60_ttft_p90"], 2)
        if rate60["ttft_p90"] else None,
        "output_tok_s_within_25pct": abs(run["output_tok_s"] / published["output_tok_s"] - 1)
        <= 0.25,
        "ttft_p90_same_order": bool(run["ttft_p90"])
        and 0.1 <= run["ttft_p90"] / published["ttft_p90"] <= 10,
    }


def run_ladders(step_models: Sequence[str], routers: Sequence[str] = tuple(ROUTERS)
                ) -> dict[str, Any]:
    workload = ladder_workload()
    runs = []
    for step_model in step_models:
        for router in routers:
            started = time.time()
            run = run_ladder(router, step_model, workload)
            run["vs_published"] = compare(run)
            runs.append(run)
            print(f"== ladder, {ROUTERS[router]}, {step_model}: {run['output_tok_s']:,} tok/s, "
                  f"TTFT p90 {run['ttft_p90']:.3g} s, ITL {run['itl_mean_ms']:.1f} ms, "
                  f"unfinished {run['unfinished']} ({time.time() - started:.0f} s)")
            print(f"   vs published {PUBLISHED[ROUTERS[router]]}: {run['vs_published']}")
            print("   per stage (QPS: tok/s, TTFT p90 s):",
                  ", ".join(f"{s['qps']}: {s['output_tok_s']:,}, {s['ttft_p90']:.3g}"
                            for s in run["stages"]))
    return {"published": PUBLISHED, "sources": SOURCES, "gap_seconds": GAP, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", choices=sorted(ROUTERS), action="append")
    parser.add_argument("--step-model", choices=["roofline", "linear"], action="append")
    args = parser.parse_args()
    out = run_ladders(args.step_model or ["roofline"], args.router or list(ROUTERS))
    print(json.dumps([{k: v for k, v in r.items() if k != "stages"} for r in out["runs"]],
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
