"""Streamed real-process runs of the routing panel's main members, beside the fleet simulator.

`MEMBERS` holds each member's `kvswitch bench` arguments: a ladder and time scale chosen so that
8 replicas, Envoy, the EPP or a peer, and a client receiving every token fit a 2-core machine
with the engines' clock slip near 0. Modes:
- `--commands`: print each member's bench command (run one at a time, alone on the machine if
  possible: other load shows as clock slip and client-side latency); the bench writes
  results.json, copied to benchmarks/results/streamed_<member>.json;
- `--fleet OUT`: the fleet simulator on exactly the workload each bench command builds (the
  bench's own argument parser and workload builder, same seed) for round robin, the oracle, the
  SMG model and kvswitch's default; deterministic, no lock;
- `--render FLEET`: the Markdown table per member and router: engine-side TTFT p90 (real run and
  fleet simulator), client-side TTFT p50/p90, client inter-token latency p50/p90 (per request,
  (e2e - TTFT) / (output tokens - 1)), engine-side output tok/s, clock slip, per QPS step, and
  the machine's mean 1-min load average over the target's run; written between the table
  markers of docs/benchmarks/routing-panel/streamed.md, and a bar plot of client TTFT p90
  beside it.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks" / "routing-panel" / "streamed.md"
TARGETS = "kvswitch,round-robin,oracle,smg-cache-aware"
FLEET_ROUTER = {"kvswitch": "kvswitch", "round-robin": "round-robin", "oracle": "oracle",
                "smg-cache-aware": "smg-cache-aware-model"}
TRACE = "benchmarks/traces/mooncake_conversation_30min.jsonl"
COMMON = "--replicas 8 --stream --seed 0"


@dataclass(frozen=True)
class Member:
    description: str
    panel_row: str
    """The routing panel's row this member stands for (README.md's members)."""
    args: str
    """`kvswitch bench` arguments besides COMMON and --targets."""
    targets: str = TARGETS


TRACE_ARGS = (f"--trace {TRACE} --trace-start 0 --trace-duration 180 --speedup 1.5 "
              "--profile qwen3-32b-2xh100-128k --time-scale 1.25 --drain-timeout 150")
MT_1000_30_ARGS = ("--preset multi-turn-6x1000-1000-30-1000 --qps 5,12,20 --duration 20 "
                   "--time-scale 0.5 --drain-timeout 240")

MEMBERS: dict[str, Member] = {
    "trace-0-x1.5": Member(
        description=("Mooncake conversation trace 0-180 s at 1.5x (556 requests, mean output "
                     "~340 tokens)"),
        panel_row="trace-0-x1.5",
        args=TRACE_ARGS),
    "bursts-6000-1200": Member(
        description=("150x5 shared prefix (6,000-token system prompts) in bursts of 10-50, "
                     "QPS 10 / 20, 20 s each"),
        panel_row="bursts-6000-1200",
        args=("--preset shared-prefix-150x5-6000-1200-1000 --arrivals bursts --qps 10,20 "
              "--duration 20 --time-scale 0.5 --drain-timeout 240")),
    "sp-6000-1200-g40": Member(
        description=("the 6,000-token shared-prefix preset at 40 groups (of 150) x 5 users, "
                     "QPS 6 / 18, 20 s each"),
        panel_row="sp-6000-1200 (150 groups)",
        args=("--preset shared-prefix-150x5-6000-1200-1000 --groups 40 --qps 6,18 "
              "--duration 20 --time-scale 0.5 --drain-timeout 240")),
    "mt-1000-30": Member(
        description=("multi-turn 6 x 1,000 conversations, 30-token questions, QPS 5 / 12 / 20, "
                     "20 s each"),
        panel_row="mt-1000-30",
        args=MT_1000_30_ARGS),
    # The trace again on a later EPP tree: kvswitch alone, as the other targets run no EPP.
    "trace-0-x1.5-0b07caf": Member(
        description="trace-0-x1.5 again, kvswitch only, with the EPP of 0b07caf",
        panel_row="trace-0-x1.5",
        args=TRACE_ARGS,
        targets="kvswitch"),
    # The trace and the multi-turn member again with the default as of 9ce25e7 (the copy of a
    # short prefix, gated on a replica with no prefill ahead): kvswitch alone.
    "trace-0-x1.5-9ce25e7": Member(
        description="trace-0-x1.5 again, kvswitch only, with the default of 9ce25e7",
        panel_row="trace-0-x1.5",
        args=TRACE_ARGS,
        targets="kvswitch"),
    "mt-1000-30-9ce25e7": Member(
        description="mt-1000-30 again, kvswitch only, with the default of 9ce25e7",
        panel_row="mt-1000-30",
        args=MT_1000_30_ARGS,
        targets="kvswitch"),
}
# The four members again with the default as of bce301b (saturationQuantile, speculativeTtl
# 30 s): kvswitch alone.
MEMBERS.update({f"{name}-bce301b": Member(
    description=f"{name} again, kvswitch only, with the default of bce301b",
    panel_row=MEMBERS[name].panel_row, args=MEMBERS[name].args, targets="kvswitch")
    for name in ("trace-0-x1.5", "bursts-6000-1200", "sp-6000-1200-g40", "mt-1000-30")})
# The multi-turn member again, every target, once its turns ran as user sessions (a next turn
# waits for the previous one and carries the engine's answer); the rows above ran open loop.
MEMBERS["mt-1000-30-sessions"] = Member(
    description=("mt-1000-30 as user sessions: a next turn waits for the previous one and "
                 "carries the engine's answer"),
    panel_row="mt-1000-30", args=MT_1000_30_ARGS)


def bench_argv(member: str) -> list[str]:
    return shlex.split(f"{MEMBERS[member].args} {COMMON} --targets {MEMBERS[member].targets}")


def commands() -> None:
    for member in MEMBERS:
        print(f"kvswitch bench {shlex.join(bench_argv(member))} "
              f"--out /tmp/streamed/{member} && cp /tmp/streamed/{member}/results.json "
              f"benchmarks/results/streamed_{member}.json")


def fleet(out: Path, members: list[str]) -> None:
    from kvswitch.bench import cli
    from kvswitch.bench.fleet import make_router, run_fleet
    from kvswitch.engine.sim.profiles import get_profile

    saved: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    for member in members:
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        args = parser.parse_args(bench_argv(member))
        workload = cli._workload(args)  # the bench's own builder: the very same requests
        profile = get_profile(args.profile)
        rows = {}
        for target in MEMBERS[member].targets.split(","):
            router = make_router(FLEET_ROUTER[target], seed=args.seed)
            result = run_fleet(workload, router, profile, args.replicas, seed=args.seed)
            rows[target] = result.to_json()
            print(f"{member} {target}: TTFT p90 {result.overall['ttft_p90']:.3g} "
                  f"({result.wall_seconds:.0f} s wall)", flush=True)
        tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=False,
                              capture_output=True, text=True).stdout.strip()
        saved[member] = {"command": "python benchmarks/streamed_panel.py --fleet "
                                    f"{out.name} --members {member}", "tree": tree,
                         "bench_args": shlex.join(bench_argv(member)),
                         "requests": len(workload.requests), "routers": rows}
        out.write_text(json.dumps(saved, indent=1))


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def table(fleet_runs: dict[str, Any]) -> tuple[str, dict[str, dict[str, float]]]:
    """One row per member, QPS step and router; and the client TTFT p90 of each member's
    last step per router (for the plot)."""
    head = ("| member | QPS | router | engine TTFT p90 (fleet sim) | client TTFT p50 | client "
            "TTFT p90 | ITL p50 | ITL p90 | output tok/s | requests ok | clock slip | load avg |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    client_p90: dict[str, dict[str, float]] = {}
    for member in MEMBERS:
        path = RESULTS / f"streamed_{member}.json"
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        sim = fleet_runs.get(member, {}).get("routers", {})
        for i, rate in enumerate(report["meta"]["qps"]):
            for t in report["targets"]:
                name = t["target"]
                if "unavailable" in t:
                    lines.append(f"| {member} | {rate:.3g} | {name} | unavailable: "
                                 f"{t['unavailable'][:80]} |" + " |" * 8)
                    continue
                engine, client = t["engine"]["steps"][i], t["steps"][i]
                fleet_steps = sim.get(name, {}).get("steps", [])
                fleet_p90 = fleet_steps[i]["ttft_p90"] if i < len(fleet_steps) else None
                if i == len(report["meta"]["qps"]) - 1:
                    client_p90.setdefault(member, {})[name] = client["ttft_p90"]
                lines.append(
                    f"| {member} | {rate:.3g} | {name} | {_fmt(engine['ttft_p90'])} "
                    f"({_fmt(fleet_p90)}) | {_fmt(client['ttft_p50'])} | "
                    f"{_fmt(client['ttft_p90'])} | {_ms(client['itl_p50'])} | "
                    f"{_ms(client['itl_p90'])} | {_fmt(engine['output_tok_s'])} | "
                    f"{client['succeeded']}/{client['requests']} | "
                    f"{_fmt(engine['clock_slip_max_fraction'], 2)} | "
                    f"{_fmt(t['cpu'].get('load_avg_1m_mean'), 2)} |")
    return "\n".join(lines), client_p90


def plot(client_p90: dict[str, dict[str, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    members = list(client_p90)
    targets = TARGETS.split(",")
    fig, ax = plt.subplots(figsize=(10, 5.5))
    width = 0.8 / len(targets)
    for i, target in enumerate(targets):
        ys = [client_p90[m].get(target) for m in members]
        ax.bar([j + i * width for j in range(len(members))],
               [float("nan") if y is None else y for y in ys], width, label=target)
    ax.set_xticks([j + width * (len(targets) - 1) / 2 for j in range(len(members))], members,
                  rotation=30, ha="right")  # the reruns' long names
    ax.set_yscale("log")
    ax.set_ylabel("client-side TTFT p90 (simulated s, log)")
    ax.set_title("streamed real-process runs, 8 replicas: client-side TTFT p90 at each "
                 "member's last QPS step", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def render(fleet_path: Path) -> None:
    fleet_runs = json.loads(fleet_path.read_text()) if fleet_path.exists() else {}
    text, client_p90 = table(fleet_runs)
    print(text)
    page = PAGE.read_text()
    page = re.sub(r"(<!-- streamed table -->\n).*?(<!-- /streamed table -->)",
                  lambda m: m.group(1) + text + "\n" + m.group(2), page, flags=re.DOTALL)
    PAGE.write_text(page)
    if client_p90:
        plot(client_p90, PAGE.parent / "streamed_ttft_p90.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--commands", action="store_true")
    mode.add_argument("--fleet", type=Path, metavar="OUT")
    mode.add_argument("--render", type=Path, metavar="FLEET")
    parser.add_argument("--members", default=",".join(MEMBERS),
                        help="comma-separated subset of: " + ", ".join(MEMBERS))
    args = parser.parse_args(argv)
    members = [m.strip() for m in args.members.split(",") if m.strip()]
    unknown = set(members) - set(MEMBERS)
    if unknown:
        parser.error(f"unknown members: {sorted(unknown)}")
    if args.commands:
        commands()
    elif args.fleet:
        fleet(args.fleet, members)
    else:
        render(args.render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
