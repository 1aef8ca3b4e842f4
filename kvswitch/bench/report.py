"""Summaries, JSON, Markdown and PNG plots of a bench run.

Headline, per target and QPS step: the engines' own measurements from their request logs
(`kvswitch.bench.engine_report`: TTFT, queue, ITL, e2e, cache hit, output tok/s by
inference-perf's definition, and each engine's clock slip). Beside them, labelled "client":
what the load generator measured (TTFT and ITL only when streamed; e2e; output tokens / simulated
seconds from the step's first send to its last completion), which also holds the gateway,
transport and any CPU contention. Per target: the engines' prefix-cache hit rate
(vllm:prefix_cache_hits / queries deltas), requests per replica and their imbalance
(max / mean; 1.0 is perfect balance).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvswitch.bench.client import RequestResult
from kvswitch.bench.engine_report import engine_summary, percentile
from kvswitch.bench.runner import TargetRun

__all__ = ["markdown", "percentile", "plots", "step_summary", "target_summary", "write_report"]


def _throughput(ok: Sequence[RequestResult]) -> float | None:
    """Output tokens / simulated seconds from the first send to the last completion."""
    if not ok:
        return None
    span = max(r.sent_at + (r.e2e or 0.0) for r in ok) - min(r.sent_at for r in ok)
    return sum(r.output_tokens for r in ok) / span if span > 0 else None


def step_summary(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [r.itl for r in ok if r.itl is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results),
        "succeeded": len(ok),
        "success_rate": len(ok) / len(results) if results else None,
        "ttft_p50": percentile(ttft, 0.5), "ttft_p90": percentile(ttft, 0.9),
        "ttft_p99": percentile(ttft, 0.99),
        "itl_p50": percentile(itl, 0.5), "itl_p90": percentile(itl, 0.9),
        "e2e_p50": percentile(e2e, 0.5), "e2e_p90": percentile(e2e, 0.9),
        "output_tok_s": _throughput(ok),
        "client_cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def target_summary(run: TargetRun, qps: Sequence[float], stage_duration: float,
                   time_scale: float = 1.0) -> dict[str, Any]:
    if run.unavailable:
        return {"target": run.target, "unavailable": run.unavailable}
    steps = []
    for stage, rate in enumerate(qps):
        stage_results = [r for r in run.results if r.stage == stage]
        steps.append({"qps": rate, **step_summary(stage_results, stage_duration)})
    queries = sum(c.cache_queries for c in run.counters.values())
    hits = sum(c.cache_hits for c in run.counters.values())
    per_replica = {a: c.requests for a, c in run.counters.items()}
    mean = sum(per_replica.values()) / len(per_replica) if per_replica else 0.0
    ttft_count = sum(c.ttft_count for c in run.counters.values())
    ok_ttft = [r.ttft for r in run.results if r.ok and r.ttft is not None]
    e2e_count = sum(c.e2e_count for c in run.counters.values())
    itl_count = sum(c.itl_count for c in run.counters.values())
    ok = [r for r in run.results if r.ok]
    client_tokens = sum(r.output_tokens - 1 for r in ok if r.itl is not None)
    tails = [r.tail for r in ok if r.tail is not None]
    return {
        "target": run.target,
        "wall_seconds": run.wall_seconds,
        "stream": run.stream,
        "engine": engine_summary(run.engine_records, run.start_wall, time_scale,
                                 stage_duration, qps),
        "steps": steps,
        "overall": step_summary(run.results, stage_duration * len(qps)),
        "engine_cache_hit_rate": hits / queries if queries else None,
        "requests_per_replica": per_replica,
        "prompt_tokens_per_replica": {a: c.prompt_tokens for a, c in run.counters.items()},
        "load_imbalance": max(per_replica.values()) / mean if mean else None,
        "preemptions": sum(c.preemptions for c in run.counters.values()),
        # Mean TTFT by the engines' own clock (histogram sum / count deltas) next to the client's
        # (wall x time scale, includes the gateway): close values mean the processes kept up
        # with the simulated clock; a client mean far above the engines' means starvation or
        # gateway overhead.
        "engine_ttft_mean": (sum(c.ttft_sum for c in run.counters.values()) / ttft_count
                             if ttft_count else None),
        "client_ttft_mean": sum(ok_ttft) / len(ok_ttft) if ok_ttft else None,
        # The same for the rest of a request: the engines' mean gap between tokens and e2e
        # against the client's (token-weighted ITL; e2e), and the client's mean wait from the
        # last response message to the end of the call (the trailers).
        "engine_itl_mean": (sum(c.itl_sum for c in run.counters.values()) / itl_count
                            if itl_count else None),
        "client_itl_mean": (sum(r.itl * (r.output_tokens - 1) for r in ok if r.itl is not None)
                            / client_tokens if client_tokens else None),
        "engine_e2e_mean": (sum(c.e2e_sum for c in run.counters.values()) / e2e_count
                            if e2e_count else None),
        "client_e2e_mean": sum(r.e2e for r in ok if r.e2e) / len(ok) if ok else None,
        "client_tail_mean": sum(tails) / len(tails) if tails else None,
        "cpu": run.cpu,
    }


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _header(*names: str) -> list[str]:
    return [_row(*names), "|" + "---|" * len(names)]


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or not b:
        return "-"
    return f"{a / b:,.0f}x" if a / b >= 1000 else f"{a / b:.3g}x"


def _ratios(targets: list[dict[str, Any]], qps: list[float]) -> list[str]:
    """kvswitch against the oracle, round robin and SMG per step (engine-side), when present."""
    steps = {t["target"]: t["engine"]["steps"] for t in targets}
    if "kvswitch" not in steps:
        return []
    kv = steps["kvswitch"]
    columns = [("oracle", "TTFT p90 kvswitch / oracle", "ttft_p90", False),
               ("round-robin", "TTFT p90 round robin / kvswitch", "ttft_p90", True),
               ("round-robin", "output tok/s kvswitch / round robin", "output_tok_s", False),
               ("smg-cache-aware", "TTFT p90 SMG / kvswitch", "ttft_p90", True),
               ("smg-cache-aware", "output tok/s kvswitch / SMG", "output_tok_s", False)]
    present = [c for c in columns if c[0] in steps]
    if not present:
        return []
    lines = ["", "## kvswitch against the others, per QPS step (engine-side)", "",
             *_header("QPS", *(c[1] for c in present))]
    for i, rate in enumerate(qps):
        cells = []
        for other, _, key, inverse in present:
            mine, theirs = kv[i][key], steps[other][i][key]
            cells.append(_ratio(theirs, mine) if inverse else _ratio(mine, theirs))
        lines.append(_row(f"{rate:g}", *cells))
    return lines


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    targets = [t for t in report["targets"] if "steps" in t]
    lines = [f"# kvswitch bench: {meta['preset']}", "",
             f"Command: `{meta['command']}`", "",
             (f"{meta['replicas']} replicas, profile `{meta['profile']}`, time scale "
              f"{meta['time_scale']:g}: **latencies are simulated seconds** (wall x time scale). "
              f"{meta['requests']} requests, seed {meta['seed']}, QPS ladder {meta['qps']} "
              f"({meta['stage_duration']:g} simulated s per step), "
              f"{'streamed' if meta.get('stream', True) else 'non-streamed'} requests."), "",
             ("Headline numbers are the engines' own (their request logs, engine clock): the "
              "same measurement for every target. Output tok/s is inference-perf's: output "
              "tokens of a step's successful requests / (its latest finish - earliest arrival). "
              "Client-side numbers follow, labelled."), ""]
    trace = meta.get("trace")
    if trace:
        lines += [(f"Trace `{trace['source']}`: {trace['duration']:g} s from {trace['start']:g} s, "
                   f"{trace['speedup']:g}x faster; {trace['replayed']} rows replayed, "
                   f"{trace['skipped']} longer than max_model_len left out "
                   f"(rows {trace['skipped_rows'][:20]}{' ...' if trace['skipped'] > 20 else ''})"
                   f". Ideal prefix-hit ratio (infinite cache shared by all): "
                   f"{_fmt(trace['ideal_hit_ratio'])} in 512-token trace blocks, "
                   f"{_fmt(meta.get('ideal_prefix_hit_ratio'))} in the engines' blocks."), ""]
    elif meta.get("ideal_prefix_hit_ratio") is not None:
        lines += [(f"Ideal prefix-hit ratio (infinite cache shared by all): "
                   f"{_fmt(meta['ideal_prefix_hit_ratio'])}; arrivals: "
                   f"{meta.get('arrivals', 'poisson')}."), ""]
    for t in report["targets"]:
        if "unavailable" in t:
            lines.append(f"- {t['target']}: unavailable: {t['unavailable']}")
    lines += ["## Engine-side TTFT p90 (s) / output tok/s per QPS step", "",
              *_header("QPS", *(t["target"] for t in targets))]
    for i, rate in enumerate(meta["qps"]):
        lines.append(_row(f"{rate:g}", *(
            f"{_fmt(t['engine']['steps'][i]['ttft_p90'])} / "
            f"{_fmt(t['engine']['steps'][i]['output_tok_s'])}" for t in targets)))
    lines += ["", "## Engine-side, per QPS step", "",
              *_header("target", "QPS", "requests", "TTFT p50", "TTFT p90", "TTFT p99",
                       "queue p90", "ITL p50", "e2e p90", "output tok/s", "cache hit",
                       "clock slip")]
    for t in targets:
        for step in t["engine"]["steps"]:
            lines.append(_row(t["target"], f"{step['qps']:g}", step["requests"],
                              *(_fmt(step[k]) for k in (
                                  "ttft_p50", "ttft_p90", "ttft_p99", "queue_p90", "itl_p50",
                                  "e2e_p90", "output_tok_s", "cache_hit_rate",
                                  "clock_slip_max_fraction"))))
    lines += _ratios(targets, meta["qps"])
    lines += ["", "## Overall", "",
              ("Engine-side latencies over the whole run; engine cache hit from the "
               "vllm:prefix_cache counters; success as the client saw it."), "",
              *_header("target", "TTFT p50", "TTFT p90", "TTFT p99", "ITL p50", "e2e p90",
                       "output tok/s", "success (client)", "engine cache hit", "imbalance",
                       "preemptions")]
    for t in targets:
        o = t["engine"]["overall"]
        lines.append(_row(t["target"], *(_fmt(o[k]) for k in (
            "ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "e2e_p90", "output_tok_s")),
            _fmt(t["overall"]["success_rate"]), _fmt(t["engine_cache_hit_rate"]),
            _fmt(t["load_imbalance"]), _fmt(t["preemptions"])))
    lines += ["", ("## Client-side, per QPS step (load generator: includes the gateway, "
               "transport and CPU contention)"), "",
              ("TTFT only when streamed. Output tok/s: output tokens / simulated s from the "
               "step's first send to its last completion."), "",
              *_header("target", "QPS", "TTFT p50", "TTFT p90", "e2e p50", "e2e p90",
                       "output tok/s", "success")]
    for t in targets:
        for step in t["steps"]:
            lines.append(_row(t["target"], f"{step['qps']:g}", *(_fmt(step[k]) for k in (
                "ttft_p50", "ttft_p90", "e2e_p50", "e2e_p90", "output_tok_s")),
                f"{step['succeeded']}/{step['requests']}"))
    lines += ["", "## CPU and clock slip during each target's run", "",
              ("Cores = CPU seconds / wall seconds over the run. A Python process cannot use more "
               "than ~1 core. Clock slip: simulated time an engine's clock dropped because it fell "
               "behind (largest over the engines, seconds and fraction of the run); near 0 means "
               "the time scale held. Engine vs client mean e2e: the gap is time outside the "
               "engines (gateway, transport, client)."), "",
              *_header("target", "wall s", "load 1m mean / max", "machine busy cores mean / max",
                       "bench cores (engines, envoy, epp, smg, client)",
                       "busiest process (mean / peak)", "clock slip max s / fraction",
                       "engine / client mean e2e")]
    for t in targets:
        cpu = t.get("cpu") or {}
        if not cpu.get("available"):
            continue
        roles = cpu["bench_cores_by_role"]
        engine = t["engine"]
        lines.append(_row(
            t["target"], f"{cpu['wall_seconds']:.0f}",
            f"{cpu['load_avg_1m_mean']:.2f} / {cpu['load_avg_1m_max']:.2f}",
            f"{_fmt(cpu['machine_busy_cores_mean'])} / {_fmt(cpu['machine_busy_cores_max'])}",
            ", ".join(_fmt(roles.get(r)) for r in ("engine", "envoy", "epp", "smg", "client")),
            f"{cpu['busiest_process']} {cpu['busiest_process_cores_mean']:.2f} / "
            f"{cpu['busiest_process_cores_peak']:.2f}",
            f"{_fmt(engine['clock_slip_max_s'])} / {_fmt(engine['clock_slip_max_fraction'])}",
            f"{_fmt(t.get('engine_e2e_mean'))} / {_fmt(t.get('client_e2e_mean'))}"))
    lines.append("")
    return "\n".join(lines)


def plots(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = [t for t in report["targets"] if "steps" in t]
    qps = report["meta"]["qps"]
    written = []
    for key, label, log in (("ttft_p90", "engine-side TTFT p90 (simulated s)", True),
                            ("output_tok_s", "engine-side output tokens / simulated s", False)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for t in targets:
            ys = [s[key] for s in t["engine"]["steps"]]
            ax.plot(qps, [float("nan") if y is None else y for y in ys], marker="o",
                    label=t["target"])
        ax.set_xlabel("QPS (simulated requests / simulated s)")
        ax.set_ylabel(label + (" (log scale)" if log else ""))
        ax.set_title(f"{report['meta']['preset']}: {label} vs QPS "
                     f"({report['meta']['replicas']} replicas)", fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = out / f"{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [t["target"] for t in targets]
    left.bar(names, [t["engine_cache_hit_rate"] or 0.0 for t in targets])
    left.set_ylabel("engine prefix-cache hit rate")
    left.set_ylim(0, 1)
    left.set_title("engine prefix-cache hit rate (whole run)", fontsize=9)
    left.tick_params(axis="x", rotation=30)
    width = 0.8 / max(len(targets), 1)
    for i, t in enumerate(targets):
        counts = list(t["requests_per_replica"].values())
        right.bar([j + i * width for j in range(len(counts))], counts, width, label=t["target"])
    right.set_xlabel("replica")
    right.set_ylabel("requests served")
    right.set_title("requests per replica (load balance)", fontsize=9)
    right.legend(fontsize=8)
    fig.tight_layout()
    path = out / "cache_and_load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def write_report(report: dict[str, Any], runs: Sequence[TargetRun], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    (out / "requests.json").write_text(json.dumps(
        {r.target: [asdict(x) for x in r.results] for r in runs}))
    (out / "summary.md").write_text(markdown(report))
    return [out / "results.json", out / "requests.json", out / "summary.md", *plots(report, out)]
