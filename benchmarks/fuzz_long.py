"""Long fuzzing runs: every target of tests/fuzz/targets.py with many inputs each.

Each target runs in its own process (so its peak RSS is its own) under hypothesis with
`--examples` inputs (default 100,000). Reported per target: inputs run, the first crash
(an input whose outcome is neither a valid result nor an error of the right kind; hypothesis
shrinks it, and it belongs in tests/fuzz as a regression case), hangs (inputs slower than
`--hang-seconds`), the slowest input's time, peak RSS and wall time. Prints a table and saves
JSON.

    .venv/bin/python benchmarks/fuzz_long.py                       # all targets, 100k each
    .venv/bin/python benchmarks/fuzz_long.py --examples 2000 --targets h2-client,http1-requests
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_one(name: str, examples: int, hang_seconds: float) -> dict[str, object]:
    """Fuzz one target in this process; the report as a dict."""
    from hypothesis import HealthCheck, given, settings

    from tests.fuzz.targets import TARGETS

    target = TARGETS[name]
    seen = {"inputs": 0, "slowest": 0.0, "hangs": 0}

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(target.inputs)
    def fuzz(value: object) -> None:
        started = time.perf_counter()
        try:
            target.check(value)
        finally:
            took = time.perf_counter() - started
            seen["inputs"] += 1
            seen["slowest"] = max(seen["slowest"], took)
            if took > hang_seconds:
                seen["hangs"] += 1

    started = time.monotonic()
    crash = None
    try:
        fuzz()
    except BaseException as exc:  # noqa: BLE001 - a crash is the finding to report
        crash = _describe(exc)
    return {"target": name, "inputs": seen["inputs"], "crash": crash, "hangs": seen["hangs"],
            "slowest_input_s": round(seen["slowest"], 4),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "wall_s": round(time.monotonic() - started, 1)}


def _describe(exc: BaseException) -> str:
    """Each distinct failure's exception line and the input hypothesis shrank it to."""
    found = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
    parts = []
    for failure in found:
        lines = "".join(traceback.format_exception_only(type(failure), failure)).splitlines()
        notes = [n for n in getattr(failure, "__notes__", ()) if "while generating" not in n]
        parts.append("\n".join([lines[0][:500], *(n[:1500] for n in notes)]))
    return "\n".join(parts)


def main() -> int:
    from tests.fuzz.targets import TARGETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100_000, help="inputs per target")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help="comma-separated target names (default: all)")
    parser.add_argument("--hang-seconds", type=float, default=5.0,
                        help="an input taking longer than this counts as a hang")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/fuzz_long.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args.examples, args.hang_seconds)))
        return 0
    reports = []
    for name in args.targets.split(","):
        if name not in TARGETS:
            parser.error(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
        child = subprocess.run(
            [sys.executable, __file__, "--child", name, "--examples", str(args.examples),
             "--hang-seconds", str(args.hang_seconds)],
            capture_output=True, text=True, cwd=REPO, check=False,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        lines = child.stdout.strip().splitlines()
        try:
            report = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            report = {"target": name, "inputs": 0, "hangs": 0, "slowest_input_s": None,
                      "peak_rss_mib": None, "wall_s": None,
                      "crash": f"the fuzzing process died ({child.returncode}): "
                               f"{child.stderr.strip()[-2000:]}"}
        reports.append(report)
        print(f"{report['target']:16} inputs={report['inputs']:>7} hangs={report['hangs']:>3} "
              f"slowest={report['slowest_input_s']}s peak_rss={report['peak_rss_mib']}MiB "
              f"wall={report['wall_s']}s crash={'none' if not report['crash'] else 'YES'}",
              flush=True)
        if report["crash"]:
            print("   " + str(report["crash"]).replace("\n", "\n   "))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"examples": args.examples, "targets": reports}, indent=2))
    print(f"saved {args.out}")
    return 1 if any(r["crash"] or r["hangs"] for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
