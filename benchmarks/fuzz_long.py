"""Long fuzzing runs: every target of tests/fuzz/targets.py with many inputs each.

Each target runs in its own process (so its peak RSS is its own) with `--examples` inputs
(default 100,000), under one of two engines:
- `hypothesis`: the target's strategy; a crash is shrunk by hypothesis;
- `atheris`: coverage-guided (libFuzzer) from the kept corpus tests/fuzz/corpus/<target>/;
  a crash, a hang (libFuzzer's `-timeout`) or running out of memory (`-rss_limit_mb`) saves the
  input under `--artifacts`, and with `--merge` the inputs that add coverage join the corpus.
Reported per target: inputs run, the first crash (an input whose outcome is neither a valid
result nor an error of the right kind: it belongs in tests/fuzz as a regression case), hangs
(inputs slower than `--hang-seconds`), the slowest input's time, peak RSS and wall time. Prints
a table and saves JSON.

    .venv/bin/python benchmarks/fuzz_long.py --engine atheris          # all targets, 100k each
    .venv/bin/python benchmarks/fuzz_long.py --examples 2000 --targets h2-client,http1-requests
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
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


def run_atheris(name: str, args: argparse.Namespace) -> dict[str, object]:
    """Fuzz one target under atheris in a child process; the report as a dict."""
    corpus = REPO / "tests/fuzz/corpus" / name
    artifacts = args.artifacts / name
    artifacts.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-"))
    hang = max(1, round(args.hang_seconds))
    started = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.atheris_main", name, f"-runs={args.examples}",
         f"-timeout={hang}", f"-rss_limit_mb={args.rss_limit_mb}", "-print_final_stats=1",
         f"-max_len={args.max_len}", f"-artifact_prefix={artifacts}/", str(work), str(corpus)],
        capture_output=True, text=True, cwd=REPO, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.monotonic() - started
    stats = dict(re.findall(r"^stat::(\w+):\s+(\d+)", child.stderr, re.MULTILINE))
    found = sorted(p.name for p in artifacts.iterdir())
    crash = None
    if child.returncode != 0:
        lines = child.stderr.splitlines()
        # The Python traceback atheris prints, else libFuzzer's own report (hang, OOM).
        start = next((i for i, line in enumerate(lines) if "Uncaught Python exception" in line),
                     max(0, len(lines) - 25))
        crash = "\n".join([f"exit {child.returncode}; saved: {', '.join(found) or 'none'}",
                           *lines[start:start + 30]])
    if args.merge and child.returncode == 0:
        subprocess.run([sys.executable, "-m", "tests.fuzz.atheris_main", name, "-merge=1",
                        f"-max_len={args.max_len}", str(corpus), str(work)],
                       capture_output=True, cwd=REPO, check=False,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    shutil.rmtree(work, ignore_errors=True)
    return {"target": name, "engine": "atheris",
            "inputs": int(stats.get("number_of_executed_units", 0)), "crash": crash,
            "hangs": sum(f.startswith("timeout-") for f in found),
            "ooms": sum(f.startswith("oom-") for f in found),
            "slowest_input_s": int(stats["slowest_unit_time_sec"])
            if "slowest_unit_time_sec" in stats else None,
            "peak_rss_mib": int(stats["peak_rss_mb"]) if "peak_rss_mb" in stats else None,
            "new_units": int(stats.get("new_units_added", 0)),
            "corpus_files": len(list(corpus.iterdir())), "wall_s": round(wall, 1)}


def main() -> int:
    from tests.fuzz.targets import TARGETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["hypothesis", "atheris"], default="hypothesis")
    parser.add_argument("--examples", type=int, default=100_000, help="inputs per target")
    parser.add_argument("--rss-limit-mb", type=int, default=2048,
                        help="atheris: a target past this RSS is out of memory (a finding)")
    parser.add_argument("--max-len", type=int, default=4096, help="atheris: longest input")
    parser.add_argument("--merge", action="store_true",
                        help="atheris: add the inputs that found new coverage to the corpus")
    parser.add_argument("--artifacts", type=Path,
                        default=Path(tempfile.gettempdir()) / "kvswitch-fuzz-artifacts",
                        help="atheris: where crashing, hanging and out-of-memory inputs are saved")
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
        report = (run_atheris(name, args) if args.engine == "atheris"
                  else run_hypothesis(name, args))
        reports.append(report)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"engine": args.engine, "examples": args.examples,
                                        "targets": reports}, indent=2))
        print(f"{report['target']:16} inputs={report['inputs']:>7} hangs={report['hangs']:>3} "
              f"slowest={report['slowest_input_s']}s peak_rss={report['peak_rss_mib']}MiB "
              f"wall={report['wall_s']}s crash={'none' if not report['crash'] else 'YES'}",
              flush=True)
        if report["crash"]:
            print("   " + str(report["crash"]).replace("\n", "\n   "))
    print(f"saved {args.out}")
    return 1 if any(r["crash"] or r["hangs"] for r in reports) else 0


def run_hypothesis(name: str, args: argparse.Namespace) -> dict[str, object]:
    """Fuzz one target under hypothesis in a child process; the report as a dict."""
    child = subprocess.run(
        [sys.executable, __file__, "--child", name, "--examples", str(args.examples),
         "--hang-seconds", str(args.hang_seconds)],
        capture_output=True, text=True, cwd=REPO, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = child.stdout.strip().splitlines()
    try:
        return {**json.loads(lines[-1]), "engine": "hypothesis"}
    except (IndexError, json.JSONDecodeError):
        return {"target": name, "engine": "hypothesis", "inputs": 0, "hangs": 0,
                "slowest_input_s": None, "peak_rss_mib": None, "wall_s": None,
                "crash": f"the fuzzing process died ({child.returncode}): "
                         f"{child.stderr.strip()[-2000:]}"}


if __name__ == "__main__":
    sys.exit(main())
