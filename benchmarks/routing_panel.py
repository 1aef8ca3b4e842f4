"""Routing panel: every router on every workload member, in the fleet simulator (virtual time).

Members (scaled down so one panel run takes minutes on one core; `--scale` stretches every
duration):
- the four shared-prefix / multi-turn presets of `kvswitch bench`, each on a 3-step QPS ladder
  of 20 simulated seconds per step (the presets' ladders use 50-60 s and 4-6 steps);
- Mooncake's conversation trace (benchmarks/traces/): two 3-minute slices (from 0 s and from
  900 s), each at two rates (recorded speed, and 1.5x faster);
- the same trace slice at the recorded rate with its requests spread evenly in time (the same
  prompts, no bursts);
- a bursty synthetic shape: the 150x5 shared-prefix prompts arriving in bursts of 10-50 at once
  (`--arrivals bursts`), two steps of 20 s;
- the 150x5 6,000-token shared-prefix preset on its own full-length ladder (6 to 30 QPS, 60 s
  per step, about 5,400 requests): the slowest member, `--members` leaves it out;
- held out, run only when `--members` names them (workloads no default was chosen on): four more
  3-minute slices of the same trace at 1.5x (from 300, 600, 1,200 and 1,500 s), and three
  3-minute slices of Mooncake's synthetic trace (multi-turn dialogues from public datasets,
  Poisson arrivals; from 0, 400 and 800 s, where its prefix reuse grows) at 1x and 1.5x.
Routers: round-robin, random, oracle (the bench's greedy oracle), oracle-best (per member and
step, the best by TTFT p90 of the oracle variants `kvswitch.bench.fleet.ORACLE_VARIANTS`: the greedy
oracle, its cache-conserving variant and its look-ahead variant), smg-cache-aware-model (a
model of SMG's policy with KV events, as SMG runs against kvswitch's engines, not SMG;
`--baselines` can add its no-events variant), kvswitch (`kvswitch up`'s default EPP config), and
every `--epp NAME=PATH` given.

Output (`--out`): panel.json (every router x member x step: engine-side TTFT p50/p90/p99,
queue, ITL, e2e, output tok/s, cache hit, requests per replica, rejected and unfinished
requests), panel.md (the tables), ttft_p90.png and cache_hit.png; the main table is printed.
The targets of issue 24 are checked per member and step for every EPP router: TTFT p90
<= 1.2x oracle-best, <= round-robin, <= smg-cache-aware-model.

`--jitter-ms J` replays every member with each arrival moved later by a uniform draw in
[0, J) ms from `--seed` (`jittered`): the same workload, timing within the trace's
millisecond resolution, the same replay for every router of the run. A TTFT p90 that moves by
tens of percent under 1 ms of jitter is decided by where a burst's queue happens to form, not
by the router; `benchmarks/routing_replays.py` summarises the targets over such replays.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvswitch.bench.fleet import ORACLE_VARIANTS, FleetResult, best_of, make_router, run_fleet
from kvswitch.bench.trace import ideal_prefix_hit_ratio, load_trace
from kvswitch.bench.workloads import PRESETS, Arrivals, build_workload
from kvswitch.engine.sim.profiles import SimProfile, get_profile
from kvswitch.tokenization import TokenizerBundle, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "benchmarks" / "traces" / "mooncake_conversation_30min.jsonl"
SYNTHETIC_TRACE = ROOT / "benchmarks" / "traces" / "mooncake_synthetic.jsonl"
BASELINES = ("round-robin", "random", "oracle", "oracle-best", "smg-cache-aware-model")
OPTIONAL = ("oracle-conserve", "oracle-lookahead", "smg-cache-aware-tree-model")
TARGETS = (("oracle-best", 1.2), ("round-robin", 1.0), ("smg-cache-aware-model", 1.0))
"""Issue 24's targets: an EPP router's TTFT p90 at most factor x the reference router's."""


@dataclass(frozen=True)
class Member:
    name: str
    build: Callable[[TokenizerBundle, float], Any]
    """(tokenizer, scale) -> workload."""
    profile: str
    description: str
    held_out: bool = False
    """Run only when `--members` names it: a workload no default was chosen on."""


def _preset(name: str, qps: tuple[float, ...], duration: float, arrivals: str = "poisson"
            ) -> Callable[[TokenizerBundle, float], Any]:
    def build(tokenizer: TokenizerBundle, scale: float) -> Any:
        return build_workload(PRESETS[name].shape, qps, duration * scale, tokenizer,
                              arrivals_shape=Arrivals(arrivals))
    return build


def _trace(start: float, duration: float, speedup: float, even: bool = False,
           path: Path = TRACE) -> Callable[[TokenizerBundle, float], Any]:
    def build(tokenizer: TokenizerBundle, scale: float) -> Any:
        workload = load_trace(path, tokenizer, start=start, duration=duration * scale,
                              speedup=speedup, max_model_len=get_profile(TRACE_PROFILE)
                              .max_model_len)
        if not even or not workload.requests:
            return workload
        gap = workload.stage_duration / len(workload.requests)
        spread = tuple(dataclasses.replace(r, send_at=i * gap)
                       for i, r in enumerate(workload.requests))
        return dataclasses.replace(workload, requests=spread)
    return build


PRESET_PROFILE = "qwen3-32b-2xh100"
TRACE_PROFILE = "qwen3-32b-2xh100-128k"
MEMBERS = (
    Member("sp-6000-1200", _preset("shared-prefix-150x5-6000-1200-1000", (6, 18, 30), 20.0),
           PRESET_PROFILE, "150 groups x 5 users, 6,000-token system prompts, QPS 6/18/30"),
    Member("sp-1000-6200", _preset("shared-prefix-150x5-1000-6200-1000", (5, 12, 20), 20.0),
           PRESET_PROFILE, "150 x 5, 1,000-token prefix, 6,200-token questions, QPS 5/12/20"),
    Member("mt-1000-30", _preset("multi-turn-6x1000-1000-30-1000", (5, 12, 20), 20.0),
           PRESET_PROFILE, "6 x 1,000 conversations, 30-token questions, QPS 5/12/20"),
    Member("mt-1000-3000", _preset("multi-turn-6x1000-1000-3000-1000", (5, 10, 15), 20.0),
           PRESET_PROFILE, "6 x 1,000 conversations, 3,000-token questions, QPS 5/10/15"),
    Member("trace-0-x1", _trace(0.0, 180.0, 1.0), TRACE_PROFILE,
           "Mooncake conversation trace 0-180 s, recorded rate"),
    Member("trace-0-x1.5", _trace(0.0, 180.0, 1.5), TRACE_PROFILE,
           "Mooncake conversation trace 0-180 s, 1.5x faster"),
    Member("trace-900-x1", _trace(900.0, 180.0, 1.0), TRACE_PROFILE,
           "Mooncake conversation trace 900-1080 s, recorded rate"),
    Member("trace-900-x1.5", _trace(900.0, 180.0, 1.5), TRACE_PROFILE,
           "Mooncake conversation trace 900-1080 s, 1.5x faster"),
    Member("trace-0-x1-even", _trace(0.0, 180.0, 1.0, even=True), TRACE_PROFILE,
           "trace 0-180 s at the recorded rate, arrivals spread evenly (no bursts)"),
    Member("bursts-6000-1200", _preset("shared-prefix-150x5-6000-1200-1000", (10, 20), 20.0,
                                       "bursts"),
           PRESET_PROFILE, "150 x 5 shared prefix in bursts of 10-50 at once, QPS 10/20"),
    Member("sp-6000-1200-ladder", _preset("shared-prefix-150x5-6000-1200-1000",
                                          PRESETS["shared-prefix-150x5-6000-1200-1000"].qps,
                                          PRESETS["shared-prefix-150x5-6000-1200-1000"]
                                          .stage_duration),
           PRESET_PROFILE, "the preset's own ladder: QPS 6/12/18/24/30, 60 s each (queues at "
                           "the saturation edge have time to build)"),
    *(Member(f"trace-{start}-x1.5", _trace(float(start), 180.0, 1.5), TRACE_PROFILE,
             f"Mooncake conversation trace {start}-{start + 180} s, 1.5x faster (held out)",
             held_out=True) for start in (300, 600, 1200, 1500)),
    *(Member(f"synthetic-{start}-x{speedup:g}",
             _trace(float(start), 180.0, speedup, path=SYNTHETIC_TRACE), TRACE_PROFILE,
             f"Mooncake synthetic trace {start}-{start + 180} s (multi-turn dialogues from "
             f"public datasets, Poisson arrivals), {speedup:g}x (held out)", held_out=True)
      for start in (0, 400, 800) for speedup in (1.0, 1.5)),
)


def select_members(names: str) -> list[Member]:
    """The members a comma-separated `--members` names, in panel order; without names, every
    member that is not held out."""
    chosen = [m.strip() for m in names.split(",") if m.strip()]
    unknown = set(chosen) - {m.name for m in MEMBERS}
    if unknown:
        raise ValueError(f"unknown members: {sorted(unknown)}")
    return [m for m in MEMBERS if m.name in chosen or not chosen and not m.held_out]


def _epp_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep:
        name, path = Path(text).stem, text
    return name, path


def jittered(workload: Any, jitter: float, seed: int) -> Any:
    """`workload` with each request sent up to `jitter` seconds later (uniform, seeded), in
    send order."""
    rng = random.Random(seed)
    moved = [dataclasses.replace(r, send_at=r.send_at + rng.uniform(0.0, jitter))
             for r in workload.requests]
    return dataclasses.replace(workload, requests=tuple(sorted(moved, key=lambda r: r.send_at)))


def replayed(member: Member, tokenizer: TokenizerBundle, scale: float, jitter_ms: float,
             seed: int) -> Any:
    """`member`'s workload as the panel replays it: built at `scale`, jittered by up to
    `jitter_ms` from `seed` (`jittered`; 0: as built)."""
    workload = member.build(tokenizer, scale)
    return jittered(workload, jitter_ms / 1000, seed) if jitter_ms else workload


def add_step_arguments(parser: argparse.ArgumentParser, routers: str | None = None) -> None:
    """What picks panel steps and replays them as the panel does (the step analyses
    `ttft_tail.py`, `group_spread.py`, `step_occupancy.py`, `conversation_turns.py` and
    `routed_past_cache.py`): --member, --step, --seed, --jitter-ms, --replicas, --scale, --out,
    and with `routers` (their default) --routers."""
    parser.add_argument("--member", required=True, choices=[m.name for m in MEMBERS])
    parser.add_argument("--step", type=int, nargs="+", default=[-1],
                        help="the QPS steps' indexes (default: the last)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--scale", type=float, default=1.0)
    if routers is not None:
        parser.add_argument("--routers", default=routers,
                            help="comma-separated fleet routers "
                                 "(kvswitch.bench.fleet.make_router)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")


@dataclass(frozen=True)
class StepReplay:
    member: Member
    workload: Any
    stages: list[int]
    """The chosen steps' stage numbers, in `--step` order."""
    stage_of: dict[str, int]
    """Request id -> its stage number."""
    args: argparse.Namespace

    def routers(self) -> list[str]:
        """The fleet routers `--routers` names, in order."""
        return [r.strip() for r in self.args.routers.split(",") if r.strip()]

    def run(self, router: Any, **options: Any) -> FleetResult:
        """The whole replay through `router` (a fleet router, or its `make_router` name)."""
        if isinstance(router, str):
            router = make_router(router, seed=self.args.seed)
        return run_fleet(self.workload, router, get_profile(self.member.profile),
                         self.args.replicas, seed=self.args.seed, **options)

    def records(self, result: FleetResult, stage: int) -> list[Any]:
        """The records of `result`'s requests sent in `stage`."""
        return [r for r in result.records if self.stage_of[r.request_id] == stage]

    def report(self, script: str, argv: list[str] | None) -> dict[str, Any]:
        """A step analysis's JSON report, its "steps" still empty: the command and member."""
        return {"command": " ".join(["python", f"benchmarks/{script}",
                                     *(sys.argv[1:] if argv is None else argv)]),
                "member": self.member.name, "steps": {}}

    def save(self, report: dict[str, Any]) -> None:
        """Write `report` to `--out`, if given."""
        if self.args.out is not None:
            self.args.out.write_text(json.dumps(report, indent=1) + "\n")


def replay_steps(parser: argparse.ArgumentParser, args: argparse.Namespace) -> StepReplay:
    """The member and steps `add_step_arguments`' arguments name, its workload jittered as the
    panel jitters it; a bad value is the parser's error."""
    if args.jitter_ms < 0:
        parser.error(f"--jitter-ms must be >= 0, got {args.jitter_ms:g}")
    member = next(m for m in MEMBERS if m.name == args.member)
    workload = replayed(member, load_tokenizer(None), args.scale, args.jitter_ms, args.seed)
    stages = sorted({r.stage for r in workload.requests})
    try:
        chosen = [stages[i] for i in args.step]
    except IndexError:
        parser.error(f"--step {args.step}: {args.member} has {len(stages)} steps")
    return StepReplay(member, workload, chosen,
                      {str(r.index): r.stage for r in workload.requests}, args)


def run_member(member: Member, routers: list[tuple[str, str]], tokenizer: TokenizerBundle,
               args: argparse.Namespace, bar: Any) -> dict[str, Any]:
    workload = replayed(member, tokenizer, args.scale, args.jitter_ms, args.seed)
    profile: SimProfile = get_profile(member.profile)
    results: dict[str, FleetResult] = {}
    variants: list[FleetResult] = []

    def run(label: str, spec: str) -> FleetResult:
        router = make_router(spec, seed=args.seed, kv_delay=args.kv_delay)
        router.name = label
        bar.set_postfix_str(f"{member.name} / {label}")
        result = run_fleet(workload, router, profile, args.replicas, seed=args.seed)
        bar.update(1)
        return result

    for label, spec in routers:
        if label == "oracle-best":
            variants += [results[v] if v in results else run(v, v) for v in ORACLE_VARIANTS]
            results[label] = best_of(variants)
        else:
            results[label] = run(label, spec)
    meta: dict[str, Any] = {"description": member.description, "profile": member.profile,
                            "requests": len(workload.requests),
                            "ideal_prefix_hit_ratio": ideal_prefix_hit_ratio(workload.requests)}
    if hasattr(workload, "skipped"):
        meta.update(skipped_rows=list(workload.skipped),
                    ideal_trace_hit_ratio=workload.ideal_hit_ratio)
    return {"member": member.name, **meta,
            "variants": {v.router: v.to_json() for v in variants},
            "routers": {k: v.to_json() for k, v in results.items()}}


def _steps(member: dict[str, Any], labels: list[str]) -> list[dict[str, Any]]:
    """The member's QPS steps, from the first router that ran it."""
    return next(member["routers"][label]["steps"] for label in labels
                if label in member["routers"])


def _step(member: dict[str, Any], label: str, i: int) -> dict[str, Any]:
    """Router `label`'s step `i` on the member; {} when that router did not run it."""
    router = member["routers"].get(label)
    return router["steps"][i] if router is not None else {}


def _fmt(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(
        value)


def check_targets(panel: list[dict[str, Any]], epp: list[str],
                  tolerance: float) -> dict[str, Any]:
    """Per EPP router: the member steps where each target of issue 24 fails (by more than
    `tolerance`, relative)."""
    out: dict[str, Any] = {}
    keys = {ref: ref if factor == 1 else f"{ref} x{factor:g}" for ref, factor in TARGETS}
    for name in epp:
        misses: dict[str, list[str]] = {key: [] for key in keys.values()}
        rows = 0
        for m in panel:
            routers = m["routers"]
            for i, step in enumerate(routers.get(name, {}).get("steps", [])):
                mine = step["ttft_p90"]
                rows += 1
                for ref, factor in TARGETS:
                    other = routers.get(ref, {}).get("steps", [{}] * (i + 1))[i].get("ttft_p90")
                    if (mine is not None and other is not None
                            and mine > factor * other * (1 + tolerance)):
                        misses[keys[ref]].append(f"{m['member']}@{step['qps']:.3g}")
        out[name] = {"rows": rows, "misses": misses,
                     "all_met": not any(misses.values())}
    return out


def markdown(panel: list[dict[str, Any]], labels: list[str], epp: list[str],
             meta: dict[str, Any]) -> str:
    lines = ["# Routing panel (fleet simulator, virtual time)", "",
             f"Command: `{meta['command']}`", "",
             (f"{meta['replicas']} replicas per member; engine-side latencies in simulated "
              f"seconds; seed {meta['seed']}"
              + (f" (arrivals jittered by up to {meta['jitter_ms']:g} ms)"
                 if meta.get("jitter_ms") else "")
              + "; KV events coalesced per 50 ms and delivered "
              f"{meta['kv_delay'] * 1000:g} ms later to the EPP; tree {meta['git']}."), "",
             "## TTFT p90 (s) per member and step; EPP routers as p90 (x oracle-best)", "",
             "| member | QPS | ideal hit | " + " | ".join(labels) + " |",
             "|---|---|---|" + "---|" * len(labels)]
    for m in panel:
        routers = m["routers"]
        for i, step in enumerate(_steps(m, labels)):
            best = routers["oracle-best"]["steps"][i]["ttft_p90"] if "oracle-best" in routers \
                else None
            cells = []
            for label in labels:
                value = _step(m, label, i).get("ttft_p90")
                cell = _fmt(value)
                if label in epp and value is not None and best:
                    cell += f" ({value / best:.2f}x)"
                cells.append(cell)
            lines.append(f"| {m['member']} | {step['qps']:.3g} | "
                         f"{_fmt(m['ideal_prefix_hit_ratio'], 2)} | " + " | ".join(cells) + " |")
    lines += ["", "oracle-best = the best of " + ", ".join(ORACLE_VARIANTS)
              + " per member and step (by TTFT p90): "
              + "; ".join(f"{m['member']}: " + ", ".join(
                  str(s.get("from")) for s in m["routers"]["oracle-best"].get("steps", []))
                  + "".join(f" (without {v})" for v in ORACLE_VARIANTS
                            if m.get("variants") and v not in m["variants"])
                          for m in panel if "oracle-best" in m["routers"]), ""]
    lines += ["## Cache hit ratio per member and step", "",
              "| member | QPS | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for m in panel:
        for i, step in enumerate(_steps(m, labels)):
            lines.append(f"| {m['member']} | {step['qps']:.3g} | " + " | ".join(
                _fmt(_step(m, label, i).get("cache_hit_rate"), 2) for label in labels) + " |")
    targets = meta.get("targets", {})
    if targets:
        lines += ["", "## Issue 24's targets (TTFT p90 per member and step)", ""]
        for name, t in targets.items():
            lines.append(f"- **{name}**: {'all met' if t['all_met'] else 'missed'} over "
                         f"{t['rows']} rows (slack {meta['tolerance']:.0%}); " + "; ".join(
                             f"worse than {k}: {', '.join(v) or 'none'}"
                             for k, v in t["misses"].items()))
    lines += ["", "## Details per member", ""]
    for m in panel:
        lines += [f"### {m['member']}: {m['description']}", "",
                  f"{m['requests']} requests, profile `{m['profile']}`"
                  + (f", {len(m['skipped_rows'])} trace rows too long left out, ideal hit in "
                     f"trace blocks {_fmt(m['ideal_trace_hit_ratio'], 2)}"
                     if "skipped_rows" in m else "") + ".", "",
                  ("| router | QPS | TTFT p50 | p90 | p99 | queue p90 | ITL p50 | e2e p90 | "
                   "tok/s | hit | per replica | rejected / unfinished |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for label in labels:
            r = m["routers"].get(label)
            if r is None:
                continue
            for step in r["steps"]:
                lines.append("| " + " | ".join([
                    label, f"{step['qps']:.3g}",
                    *(_fmt(step[k]) for k in ("ttft_p50", "ttft_p90", "ttft_p99", "queue_p90",
                                              "itl_p50", "e2e_p90")),
                    _fmt(step["output_tok_s"], 4), _fmt(step["cache_hit_rate"], 2),
                    " ".join(str(c) for c in step["requests_per_replica"]),
                    f"{len(r['rejected'])} / {len(r['unfinished'])}"]) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plots(panel: list[dict[str, Any]], labels: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, title, file, log in (("ttft_p90", "engine-side TTFT p90 (s)", "ttft_p90.png", True),
                                  ("cache_hit_rate", "cache hit ratio", "cache_hit.png", False)):
        cols = 4
        rows = (len(panel) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
        for ax, m in zip(axes.flat, panel, strict=False):
            steps = _steps(m, labels)
            xs = list(range(len(steps)))
            width = 0.8 / len(labels)
            for j, label in enumerate(labels):
                ys = [_step(m, label, i).get(key) or 0.0 for i in xs]
                ax.bar([x + j * width for x in xs], ys, width, label=label)
            ax.set_xticks([x + 0.4 - width / 2 for x in xs],
                          [f"{s['qps']:.3g}" for s in steps])
            ax.set_title(m["member"], fontsize=9)
            if log:
                ax.set_yscale("log")
        for ax in list(axes.flat)[len(panel):]:
            ax.axis("off")
        handles, names = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
        fig.suptitle(f"{title} per member and QPS step (fleet simulator)")
        fig.tight_layout(rect=(0, 0.06, 1, 0.97))
        fig.savefig(out / file, dpi=110)
        plt.close(fig)


def _best_json(variants: dict[str, Any]) -> dict[str, Any]:
    """oracle-best from saved variant runs, as `best_of` makes it."""
    def p90(summary: dict[str, Any]) -> float:
        value = summary.get("ttft_p90")
        return float("inf") if value is None else float(value)

    runs = list(variants.values())
    best = min(runs, key=lambda r: p90(r["overall"]))
    steps = []
    for i in range(len(best["steps"])):
        run = min(runs, key=lambda r: p90(r["steps"][i]))
        steps.append({**run["steps"][i], "from": run["router"]})
    return {**best, "router": "oracle-best", "steps": steps,
            "overall": {**best["overall"], "from": best["router"]}}


def merge_saved(sources: list[Path]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One panel from saved runs (over member groups, or routers of the same members, run in
    parallel or one after another): members in panel order, routers in the order first seen;
    the oracle variants, run as routers of their own, become `oracle-best`'s variants."""
    runs = [json.loads(source.read_text()) for source in sources]
    meta = dict(runs[0]["meta"])
    by_name: dict[str, dict[str, Any]] = {}
    for run in runs:
        for m in run["members"]:
            merged = by_name.setdefault(m["member"], {**m, "routers": {}, "variants": {}})
            merged["routers"].update(m["routers"])
            merged["variants"].update(m.get("variants", {}))
    for m in by_name.values():
        found = {v: m["routers"][v] for v in ORACLE_VARIANTS if v in m["routers"]}
        m["variants"] = {**found, **m["variants"]}
        for v in ORACLE_VARIANTS[1:]:
            m["routers"].pop(v, None)
        if len(m["variants"]) >= 2:  # the panel says which variants it is the best of
            m["routers"]["oracle-best"] = {}  # recomputed from the variants by `render`
    order = [m.name for m in MEMBERS if m.name in by_name]
    panel = [by_name[name] for name in order + sorted(set(by_name) - set(order))]
    if len(runs) > 1:
        meta["commands"] = [run["meta"]["command"] for run in runs]
        meta["command"] = (f"{len(runs)} runs merged with --render (each command in "
                           f"panel.json), e.g. {runs[0]['meta']['command']}")
        meta["wall_seconds"] = sum(run["meta"].get("wall_seconds", 0.0) for run in runs)
        meta["epp"] = {k: v for run in runs for k, v in run["meta"].get("epp", {}).items()}
    return meta, panel


def render(sources: list[Path], out: Path, tolerance: float) -> int:
    meta, panel = merge_saved(sources)
    for m in panel:
        if "oracle-best" in m["routers"] and m.get("variants"):
            m["routers"]["oracle-best"] = _best_json(m["variants"])
    # Routers any member has (a missing run shows as "-"): baselines, then the EPP configs.
    have = set().union(*(set(m["routers"]) for m in panel))
    epp = [name for name in meta.get("epp", {}) if name in have]
    labels = [b for b in BASELINES + OPTIONAL if b in have] + epp
    meta["tolerance"] = tolerance
    if {"oracle-best", "round-robin", "smg-cache-aware-model"} <= set(labels):
        meta["targets"] = check_targets(panel, epp, tolerance)
    out.mkdir(parents=True, exist_ok=True)
    (out / "panel.json").write_text(json.dumps({"meta": meta, "members": panel}, indent=1))
    (out / "panel.md").write_text(markdown(panel, labels, epp, meta))
    plots(panel, labels, out)
    print(f"rendered {', '.join(map(str, sources))} into {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epp", action="append", default=[], metavar="NAME=PATH",
                        help="an EndpointPickerConfig to add (repeatable); a bare PATH is "
                             "named after its file; PATH may name a bundled config "
                             "(kvswitch/bench/configs/NAME.yaml)")
    parser.add_argument("--no-default", action="store_true",
                        help="leave out `kvswitch up`'s DEFAULT_EPP_CONFIG")
    parser.add_argument("--members", default="",
                        help="comma-separated subset of: " + ", ".join(m.name for m in MEMBERS))
    parser.add_argument("--baselines", default=",".join(BASELINES),
                        help="comma-separated, of: " + ", ".join(BASELINES + OPTIONAL))
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="stretch every member's duration (0.2 for a quick look)")
    parser.add_argument("--kv-delay", type=float, default=0.002,
                        help="seconds from a KV batch's publication to the EPP applying it")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="relative slack when checking the targets (a difference of a "
                             "step or two is not a regression)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jitter-ms", type=float, default=0.0,
                        help="move each arrival later by a uniform draw in [0, J) ms from "
                             "--seed: a replay that differs only in sub-millisecond timing, "
                             "the same for every router (default 0: as recorded)")
    parser.add_argument("--out", type=Path, default=Path("routing-panel"))
    parser.add_argument("--tree", default=None,
                        help="the code version to record (default: git describe of this "
                             "script's repository)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--render", type=Path, nargs="+", default=None, metavar="PANEL_JSON",
                        help="run nothing: rewrite panel.md and the plots from a saved "
                             "panel.json (oracle-best recomputed from its variants) into --out; "
                             "several (runs over disjoint --members groups, same routers) are "
                             "merged into one panel")
    args = parser.parse_args(argv)
    if args.render is not None:
        return render(args.render, args.out, args.tolerance)
    if args.jitter_ms < 0:
        parser.error(f"--jitter-ms must be >= 0, got {args.jitter_ms:g}")

    try:
        members = select_members(args.members)
    except ValueError as exc:
        parser.error(str(exc))
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    if set(baselines) - set(BASELINES + OPTIONAL):
        parser.error(f"unknown baselines: {sorted(set(baselines) - set(BASELINES + OPTIONAL))}")
    epp = ([] if args.no_default else [("kvswitch", "kvswitch")]) + [
        (name, f"epp:{path}") for name, path in map(_epp_arg, args.epp)]
    routers = [(b, b) for b in baselines] + epp
    for label, spec in epp:
        make_router(spec)  # fail on a bad config before running anything
    per_member = len(routers)
    if "oracle-best" in baselines:  # not a run itself: its variants are
        per_member += len(ORACLE_VARIANTS) - 1 - ("oracle" in baselines)
    runs = per_member * len(members)
    args.out.mkdir(parents=True, exist_ok=True)
    # Recorded before the runs: a commit made during a long run must not relabel it.
    git = args.tree or subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
        capture_output=True, text=True, check=False).stdout.strip() or "?"
    tokenizer = load_tokenizer(None)
    started = time.perf_counter()
    panel = []
    with tqdm(total=runs, desc="routing panel", unit="run", disable=args.no_progress) as bar:
        for member in members:
            panel.append(run_member(member, routers, tokenizer, args, bar))
    labels = [label for label, _ in routers]
    epp_labels = [label for label, _ in epp]
    command = ["python", "benchmarks/routing_panel.py", *(argv or sys.argv[1:])]
    meta = {"command": " ".join(command),
            "replicas": args.replicas, "seed": args.seed, "scale": args.scale,
            "jitter_ms": args.jitter_ms, "kv_delay": args.kv_delay, "git": git, "epp": dict(epp),
            "wall_seconds": time.perf_counter() - started,
            "tolerance": args.tolerance,
            "targets": check_targets(panel, epp_labels, args.tolerance)
            if {ref for ref, _ in TARGETS} <= set(baselines) else {}}
    (args.out / "panel.json").write_text(json.dumps({"meta": meta, "members": panel}, indent=1))
    text = markdown(panel, labels, epp_labels, meta)
    (args.out / "panel.md").write_text(text)
    plots(panel, labels, args.out)
    print(text.split("## Cache hit")[0])
    if meta["targets"]:
        print(text[text.index("## Issue 24"):text.index("## Details")])
    print(f"wrote {args.out}/panel.json, panel.md, ttft_p90.png, cache_hit.png "
          f"({meta['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
