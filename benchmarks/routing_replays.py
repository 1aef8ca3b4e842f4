"""Issue 24's targets over several replays of the routing panel (`routing_panel.py --jitter-ms`).

Each panel.json given is one replay: the same members and routers, arrivals jittered from a
different seed. Per member, step and EPP router, and per reference (oracle-best, round-robin,
smg-cache-aware-model), the ratio TTFT p90 / the reference's p90 in the same replay; the
summary is its median and worst over the replays and how many replays meet the target
(ratio <= target x (1 + tolerance): 1.2 for oracle-best, 1 for the others). The same replay
holds the router and its references, so a burst that lands badly for every router cancels
out; what it does not show is a router worse on every replay by less than the spread.

`--references SUMMARY_JSON ...` takes a reference the panels do not hold from earlier summaries
of the same replays (same members, steps, seeds and jitter), per member, step and seed: the
fleet simulator is deterministic, so a reference's replay reproduces to the last digit and
need not be rerun beside each candidate.

    python benchmarks/routing_replays.py j1/panel.json j2/panel.json ... --out replays.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_panel import TARGETS


def _p90(member: dict[str, Any], router: str, step: int) -> float | None:
    steps = member["routers"].get(router, {}).get("steps", [])
    value = steps[step].get("ttft_p90") if step < len(steps) else None
    return None if value is None else float(value)


Saved = dict[tuple[str, float, int, str], float]
"""(member, QPS, seed, reference router) -> TTFT p90, from an earlier summary."""


def saved_references(summary: dict[str, Any]) -> Saved:
    """The references' TTFT p90 per replay of an earlier `summarise` output (as written)."""
    saved: Saved = {}
    for rows in summary["summary"].values():
        for row in rows:
            for ref, values in row["references"].items():
                for seed, p90 in zip(summary["seeds"], values["ttft_p90"], strict=True):
                    if p90 is not None:
                        saved[(row["member"], round(row["qps"], 6), seed, ref)] = p90
    return saved


def summarise(replays: list[dict[str, Any]], tolerance: float,
              saved: Saved | None = None) -> dict[str, Any]:
    """{epp router: [{member, qps, ttft_p90, references: {name: {ttft_p90, ratios, median,
    worst, target, met}}}]}; a reference a replay lacks comes from `saved` if there."""
    epp = list(replays[0]["meta"]["epp"])
    seeds = [r["meta"]["seed"] for r in replays]
    out: dict[str, Any] = {}
    for name in epp:
        rows = []
        for m, first in enumerate(replays[0]["members"]):
            for i, step in enumerate(first["routers"][name]["steps"]):
                members = [r["members"][m] for r in replays]
                if any(x["member"] != first["member"] for x in members):
                    raise ValueError("the replays do not hold the same members in one order")
                mine = [_p90(x, name, i) for x in members]
                row: dict[str, Any] = {"member": first["member"], "qps": step["qps"],
                                       "ttft_p90": mine, "references": {}}
                for ref, factor in TARGETS:
                    theirs = [_p90(x, ref, i) if ref in x["routers"] else
                              (saved or {}).get((first["member"], round(step["qps"], 6), s, ref))
                              for x, s in zip(members, seeds, strict=True)]
                    ratios = [a / b for a, b in zip(mine, theirs, strict=True)
                              if a is not None and b]
                    if not ratios:
                        continue
                    row["references"][ref] = {
                        "ttft_p90": theirs, "ratios": [round(r, 4) for r in ratios],
                        "median": round(statistics.median(ratios), 4),
                        "worst": round(max(ratios), 4),
                        "target": factor,
                        "met": sum(r <= factor * (1 + tolerance) for r in ratios)}
                rows.append(row)
        out[name] = rows
    return out


def markdown(summary: dict[str, Any], replays: int, tolerance: float) -> str:
    lines = []
    for name, rows in summary.items():
        lines += [(f"## {name}: TTFT p90 over {replays} replays; its ratio to each reference "
                   f"in the same replay, median (worst), and the replays meeting the target "
                   f"(slack {tolerance:.0%})"), "",
                  "| member | QPS | p90 median (range) | "
                  + " | ".join(f"{label} (target {factor:g}x)"
                               for label, factor in TARGETS) + " |",
                  "|---|---|---|" + "---|" * len(TARGETS)]
        for row in rows:
            p90 = [v for v in row["ttft_p90"] if v is not None]
            cells = []
            for label, _ in TARGETS:
                ref = row["references"].get(label)
                cells.append("-" if ref is None else
                             f"{ref['median']:.2f} ({ref['worst']:.2f}), "
                             f"{ref['met']}/{len(ref['ratios'])}")
            lines.append(f"| {row['member']} | {row['qps']:.3g} | "
                         f"{statistics.median(p90):.3g} ({min(p90):.3g}-{max(p90):.3g}) | "
                         + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("panels", type=Path, nargs="+", metavar="PANEL_JSON",
                        help="one routing_panel.py panel.json per replay")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="relative slack on each target (default 0.02)")
    parser.add_argument("--references", type=Path, nargs="+", default=None,
                        metavar="SUMMARY_JSON",
                        help="earlier --out files of the same replays: references the panels "
                             "lack are read from them")
    parser.add_argument("--out", type=Path, default=None, help="write the summary as JSON")
    args = parser.parse_args(argv)
    # In seed order, whatever order a shell glob gave (s10 before s2).
    loaded = sorted(((json.loads(p.read_text()), p) for p in args.panels),
                    key=lambda pair: pair[0]["meta"]["seed"])
    replays = [replay for replay, _ in loaded]
    panels = [path for _, path in loaded]
    saved: Saved = {}
    for path in args.references or ():
        saved.update(saved_references(json.loads(path.read_text())))
    summary = summarise(replays, args.tolerance, saved)
    text = markdown(summary, len(replays), args.tolerance)
    print(text)
    if args.out is not None:
        args.out.write_text(json.dumps({
            "what": "issue 24's targets over replays of the routing panel "
                    "(benchmarks/routing_replays.py)",
            "panels": [str(p) for p in panels],
            "commands": [r["meta"]["command"] for r in replays],
            "trees": sorted({r["meta"]["git"] for r in replays}),
            "seeds": [r["meta"]["seed"] for r in replays],
            "jitter_ms": [r["meta"].get("jitter_ms", 0.0) for r in replays],
            "references_from": [str(p) for p in args.references or ()],
            "tolerance": args.tolerance, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
