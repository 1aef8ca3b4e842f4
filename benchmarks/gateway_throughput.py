"""Gateway overhead on this machine: direct-to-engine vs Envoy round robin vs kvswitch.

One run starts `--replicas` simulated engines on a huge time scale (so the model is not the
bottleneck), the EPP and Envoy (kvswitch, through `kvswitch.launcher.launch_gateway`) and a second,
round-robin Envoy over the same engines, then drives each target with a fixed number of
in-flight requests from `--clients` separate processes (grpc.aio):

  unary:  stream=false, max_tokens=--unary-tokens, one response per request
  stream: stream=true, max_tokens=--stream-tokens, one chunk per token

It reports tokens/s, requests/s, p50/p99 latency, Envoy's, the EPP's and the engines' CPU per
request (/proc/PID/stat), the EPP's scheduling latency (its Prometheus histogram
`kvswitch_epp_scheduler_e2e_duration_seconds`) and the load-only records the EPPs received per
request (engine load pushes and heartbeats, `kvswitch_epp_load_records_total`; with
`--epp-replicas` 2 or more the engines push their load after arrivals, `--load-push-ms`), prints
a table and saves JSON.

    .venv/bin/python benchmarks/gateway_throughput.py --duration 8 --out gateway.json

With `--epp-transports h2,grpcio` the first transport is the `kvswitch` target (launched by
`launch_gateway`) and each further one adds a `kvswitch-<transport>` target: its own EPP
(`kvswitch epp --transport ...`) and Envoy over the same engines. `--rounds N` repeats every
cell N times, interleaved (all targets of round 1, then round 2, ...), and the table, JSON
`medians` and verdicts use per-cell medians (the machine is shared; single runs are noisy).

To compare two source trees (e.g. `git archive` copies), alternate single-round runs of each and
start each from its own tree's directory with PYTHONPATH set to it: the processes are started
with `python -m kvswitch` in the current directory, which Python puts ahead of PYTHONPATH.

Targets: streamed tokens/s through kvswitch >= 95% of Envoy round robin; EPP CPU <= 0.2 ms
per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvswitch.envoy import GatewayOptions, PoolTarget, build_bootstrap, render
from kvswitch.envoy.clusters import H2C
from kvswitch.launcher import (
    GatewaySpec,
    LaunchedGateway,
    envoy_spec,
    epp_name,
    epp_spec,
    free_port,
    launch_gateway,
)
from kvswitch.supervisor import Supervisor

SCHEDULING_METRIC = "kvswitch_epp_scheduler_e2e_duration_seconds"
LOAD_RECORDS_METRIC = "kvswitch_epp_load_records_total"
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class ClientResult:
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    first_error: str = ""


@dataclass
class CellResult:
    target: str
    workload: str
    concurrency: int
    seconds: float
    requests: int
    errors: int
    tokens: int
    requests_per_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    envoy_cpu_ms_per_request: float | None = None
    epp_cpu_ms_per_request: float | None = None
    epp_cpu_ms_per_request_minus_idle: float | None = None
    """The EPP's CPU per request after subtracting its idle rate (endpoint refresh, KV-event
    subscriptions), measured before the cells with no traffic."""
    epp_scheduling_mean_ms: float | None = None
    epp_scheduling_p50_ms: float | None = None
    epp_scheduling_p99_ms: float | None = None
    engines_cpu_ms_per_request: float | None = None
    """The simulated engines' CPU per request, all of them (every target shares them)."""
    epp_load_only_records_per_request: float | None = None
    """Load-only records (engine load pushes and heartbeats) all EPPs received per request."""
    first_error: str = ""


# ---- load generation (runs in client processes) ----------------------------------------------
def _client_main(addresses: list[str], workload: str, max_tokens: int, concurrency: int,
                 warmup: float, duration: float, prompt_len: int, seed: int,
                 out: mp.Queue) -> None:  # type: ignore[type-arg]
    out.put(asdict(asyncio.run(_drive(addresses, workload, max_tokens, concurrency, warmup,
                                      duration, prompt_len, seed))))


async def _drive(addresses: list[str], workload: str, max_tokens: int, concurrency: int,
                 warmup: float, duration: float, prompt_len: int, seed: int) -> ClientResult:
    import grpc

    from kvswitch.protocol import vllm_engine_pb2 as pb
    from kvswitch.protocol import vllm_engine_pb2_grpc as rpc

    channels = [grpc.aio.insecure_channel(a, options=[("grpc.use_local_subchannel_pool", 1)])
                for a in addresses]
    stubs = [rpc.VllmEngineStub(c) for c in channels]
    rng = random.Random(seed)
    result = ClientResult()
    start = time.perf_counter()
    measure_from, stop_at = start + warmup, start + warmup + duration
    stream = workload == "stream"
    counter = 0

    async def worker(index: int) -> None:
        nonlocal counter
        while True:
            now = time.perf_counter()
            if now >= stop_at:
                return
            counter += 1
            stub = stubs[counter % len(stubs)]
            request = pb.GenerateRequest(
                request_id=f"bench-{seed}-{index}-{counter}",
                tokenized=pb.TokenizedInput(
                    input_ids=[rng.randrange(100, 100_000) for _ in range(prompt_len)]),
                sampling_params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                stream=stream)
            began = time.perf_counter()
            tokens = 0
            try:
                async for response in stub.Generate(request, timeout=60):
                    if response.HasField("chunk"):
                        tokens += len(response.chunk.token_ids)
                    elif not stream:
                        tokens += len(response.complete.output_ids)
            except grpc.aio.AioRpcError as exc:
                if measure_from <= time.perf_counter() <= stop_at:
                    result.errors += 1
                    result.first_error = result.first_error or f"{exc.code()}: {exc.details()}"
                continue
            ended = time.perf_counter()
            # Completions in the window, wherever they began: with a fixed number in flight
            # this counts the window's work (requiring both ends in it left out ~one
            # request per in-flight slot, which biased the CPU per request up).
            if measure_from <= ended <= stop_at:
                result.requests += 1
                result.tokens += tokens
                result.latencies.append(ended - began)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    for channel in channels:
        await channel.close()
    return result


# ---- measurement helpers ----------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def scrape_histogram(metrics_port: int, name: str) -> dict[str, float]:
    """`le` -> cumulative count, plus `_sum` and `_count`, summed over label sets."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        key, value = line.rsplit(" ", 1)
        if key.startswith(name + "_bucket"):
            le = key.split('le="', 1)[1].split('"', 1)[0]
            out[le] = out.get(le, 0.0) + float(value)
        elif key.startswith(name + "_sum"):
            out["_sum"] = out.get("_sum", 0.0) + float(value)
        elif key.startswith(name + "_count"):
            out["_count"] = out.get("_count", 0.0) + float(value)
    return out


def scrape_counter(metrics_port: int, name: str, label: str) -> float:
    """The sum of counter `name`'s series whose labels contain `label` (e.g. 'kind="x"')."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def _load_only_records(metrics_ports: Sequence[int]) -> float:
    return sum(scrape_counter(port, LOAD_RECORDS_METRIC, 'kind="load_only"')
               for port in metrics_ports)


def histogram_stats(before: dict[str, float], after: dict[str, float]) -> tuple[float, ...] | None:
    """(mean, p50, p99) in ms of the observations between two scrapes (quantiles: bucket
    upper bounds)."""
    count = after.get("_count", 0.0) - before.get("_count", 0.0)
    if count <= 0:
        return None
    mean = (after.get("_sum", 0.0) - before.get("_sum", 0.0)) / count
    bounds = sorted((float(le), after[le] - before.get(le, 0.0))
                    for le in after if not le.startswith("_"))

    def quantile(q: float) -> float:
        for bound, cumulative in bounds:
            if cumulative >= q * count:
                return bound
        return float("inf")

    return mean * 1e3, quantile(0.5) * 1e3, quantile(0.99) * 1e3


def idle_cpu_rate(pid: int, seconds: float) -> float:
    """CPU seconds per second `pid` burns with no traffic."""
    before = cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


def run_cell(target: str, addresses: list[str], workload: str, args: argparse.Namespace,
             envoy_pid: int | None, epps: Sequence[tuple[int, int]],
             epp_idle_rate: float = 0.0, engine_pids: Sequence[int] = ()) -> CellResult:
    """One cell; `epps` are the target's EPPs as (pid, metrics port), their CPU added up and
    their scheduling histograms merged."""
    max_tokens = args.stream_tokens if workload == "stream" else args.unary_tokens
    per_client = max(1, args.concurrency // args.clients)
    queue: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    procs = [mp.Process(target=_client_main, args=(
        addresses, workload, max_tokens, per_client, args.warmup, args.duration,
        args.prompt_len, i, queue)) for i in range(args.clients)]
    for p in procs:
        p.start()
    time.sleep(args.warmup)
    cpu_before = {pid: cpu_seconds(pid)
                  for pid in (envoy_pid, *(e[0] for e in epps), *engine_pids) if pid}
    hist_before = _merged_histogram([e[1] for e in epps])
    records_before = _load_only_records([e[1] for e in epps])
    time.sleep(args.duration)
    cpu_after = {pid: cpu_seconds(pid) for pid in cpu_before}
    hist_after = _merged_histogram([e[1] for e in epps])
    records_after = _load_only_records([e[1] for e in epps])
    results = [ClientResult(**queue.get(timeout=args.duration + 120)) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    latencies = sorted(x for r in results for x in r.latencies)
    requests = sum(r.requests for r in results)
    cell = CellResult(
        target=target, workload=workload, concurrency=per_client * args.clients,
        seconds=args.duration, requests=requests, errors=sum(r.errors for r in results),
        tokens=sum(r.tokens for r in results), requests_per_s=requests / args.duration,
        tokens_per_s=sum(r.tokens for r in results) / args.duration,
        p50_ms=statistics.median(latencies) * 1e3 if latencies else float("nan"),
        p99_ms=latencies[int(0.99 * (len(latencies) - 1))] * 1e3 if latencies else float("nan"),
        first_error=next((r.first_error for r in results if r.first_error), ""),
    )
    # CPU per request over the measured window (the requests that ended in it).
    if engine_pids and requests:
        cell.engines_cpu_ms_per_request = sum(
            cpu_after[pid] - cpu_before[pid] for pid in engine_pids) / requests * 1e3
    if envoy_pid and requests:
        cell.envoy_cpu_ms_per_request = (cpu_after[envoy_pid] - cpu_before[envoy_pid]) \
            / requests * 1e3
    if epps and requests:
        used = sum(cpu_after[pid] - cpu_before[pid] for pid, _ in epps)
        cell.epp_cpu_ms_per_request = used / requests * 1e3
        cell.epp_cpu_ms_per_request_minus_idle = max(
            0.0, used - epp_idle_rate * args.duration) / requests * 1e3
        cell.epp_load_only_records_per_request = (records_after - records_before) / requests
        stats = histogram_stats(hist_before, hist_after)
        if stats:
            (cell.epp_scheduling_mean_ms, cell.epp_scheduling_p50_ms,
             cell.epp_scheduling_p99_ms) = stats
    return cell


def _merged_histogram(metrics_ports: Sequence[int]) -> dict[str, float]:
    merged: dict[str, float] = {}
    for port in metrics_ports:
        for key, value in scrape_histogram(port, SCHEDULING_METRIC).items():
            merged[key] = merged.get(key, 0.0) + value
    return merged


# ---- orchestration ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument("--time-scale", type=float, default=10_000.0)
    parser.add_argument("--concurrency", type=int, default=32, help="in-flight requests, total")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds per cell")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--unary-tokens", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--envoy-concurrency", type=int, default=1)
    parser.add_argument("--targets", default="direct,envoy-rr,kvswitch",
                        help="kvswitch = the first --epp-transports entry; the others are added "
                             "as kvswitch-<transport>")
    parser.add_argument("--epp-transports", default="h2",
                        help="EPP ext_proc transports to compare (kvswitch epp --transport)")
    parser.add_argument("--epp-replicas", type=int, default=1,
                        help="EPPs behind the kvswitch target's Envoy (CPU per request is "
                             "their sum)")
    parser.add_argument("--load-push-ms", type=float, default=None,
                        help="the engines' --load-push-ms (unset: the engine's default, 1); "
                             "pushes go out only with two or more EPPs")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repeats of every cell")
    parser.add_argument("--workloads", default="unary,stream")
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = parser.parse_args(argv)

    state = Path(tempfile.mkdtemp(prefix="kvswitch-bench-"))  # kept: every process's log
    print(f"logs and configs: {state}", flush=True)
    transports = args.epp_transports.split(",")
    with Supervisor(state) as supervisor:
        gateway = launch_gateway(supervisor, GatewaySpec(
            port=free_port(), replicas=args.replicas, profile=args.profile,
            time_scale=args.time_scale, mode="random", grace_period=1.0,
            envoy_concurrency=args.envoy_concurrency, epp_replicas=args.epp_replicas,
            epp_args=("--transport", transports[0]),
            engine_args=(() if args.load_push_ms is None
                         else ("--load-push-ms", f"{args.load_push_ms:g}"))), state)
        engines = list(gateway.endpoints)
        rr_port, rr_admin = free_port(), free_port()
        rr_config = state / "envoy-rr.yaml"
        rr_config.write_text(render(build_bootstrap(GatewayOptions(
            pool=PoolTarget(tuple(engines)), port=rr_port, admin_port=rr_admin,
            round_robin=True))))
        rr = supervisor.start(envoy_spec(rr_config, rr_admin, name="envoy-rr",
                                         concurrency=args.envoy_concurrency))
        epps = [(supervisor.get(epp_name(i, args.epp_replicas)).pid, metrics)
                for i, metrics in enumerate(gateway.ports.epp_metrics)]
        targets: dict[str, tuple[list[str], int | None, list[tuple[int, int]]]] = {
            "direct": (engines, None, []),
            "envoy-rr": ([f"127.0.0.1:{rr_port}"], rr.pid, []),
            "kvswitch": ([gateway.address], supervisor.get("envoy").pid, epps),
        }
        names = args.targets.split(",")
        extra = [f"kvswitch-{t}" for t in transports[1:]]
        for name in extra:
            targets[name] = _extra_gateway(supervisor, gateway, name.split("-", 1)[1], args)
        if "kvswitch" in names:
            at = names.index("kvswitch") + 1
            names[at:at] = extra
        idle = {name: sum(idle_cpu_rate(pid, 3.0) for pid, _ in info[2])
                for name, info in targets.items() if info[2]}
        for name, rate in idle.items():
            print(f"EPP idle CPU ({name}): {rate * 1e3:.1f} ms/s", flush=True)
        engine_pids = [supervisor.get(gateway.engine_name(a)).pid for a in engines]
        cells: list[CellResult] = []
        for index in range(args.rounds):
            for workload in args.workloads.split(","):
                for name in names:
                    addresses, envoy_pid, epp_info = targets[name]
                    cell = run_cell(name, addresses, workload, args, envoy_pid, epp_info,
                                    idle.get(name, 0.0), engine_pids)
                    cells.append(cell)
                    print(f"r{index + 1} {_row(cell)}", flush=True)
    medians = _medians(cells)
    report = {"config": {k: (str(v) if isinstance(v, Path) else v)
                         for k, v in vars(args).items()},
              "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
              "epp_idle_cpu_ms_per_s": {k: v * 1e3 for k, v in idle.items()},
              "cells": [asdict(c) for c in cells], "medians": [asdict(c) for c in medians],
              "targets": _verdicts(medians), "logs": str(state)}
    print()
    print(_table(medians))
    for line in report["targets"]:
        print(line)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"saved {args.out}")
    return 0


def _extra_gateway(supervisor: Supervisor, gateway: LaunchedGateway, transport: str,
                   args: argparse.Namespace) -> tuple[list[str], int, tuple[int, int]]:
    """Another EPP (on `transport`) and Envoy over the same engines, config and pool."""
    port, metrics = free_port(), free_port()
    state = gateway.state_dir
    spec = epp_spec(state / "epp.yaml", state / "pool.yaml", port, metrics,
                    ("--transport", transport), want_ready=len(gateway.endpoints))
    epp = supervisor.start(replace(spec, name=f"epp-{transport}"))
    public, admin = free_port(), free_port()
    config = state / f"envoy-{transport}.yaml"
    config.write_text(render(build_bootstrap(GatewayOptions(
        pool=PoolTarget(gateway.endpoints, H2C), epps=(f"127.0.0.1:{port}",), port=public,
        admin_port=admin, routing=gateway.spec.routing))))  # type: ignore[arg-type]
    envoy = supervisor.start(envoy_spec(config, admin, name=f"envoy-{transport}",
                                        concurrency=args.envoy_concurrency))
    return [f"127.0.0.1:{public}"], envoy.pid, [(epp.pid, metrics)]


def _medians(cells: list[CellResult]) -> list[CellResult]:
    """One cell per (workload, target): the median of every number over the rounds."""
    groups: dict[tuple[str, str], list[CellResult]] = {}
    for cell in cells:
        groups.setdefault((cell.workload, cell.target), []).append(cell)
    out = []
    for group in groups.values():
        merged = asdict(group[0])
        for key, value in merged.items():
            if isinstance(value, float) or (isinstance(value, int) and key != "concurrency"):
                values = [getattr(c, key) for c in group if getattr(c, key) is not None]
                median = statistics.median(values) if values else None
                # an even number of rounds makes a count's median a float: keep counts whole
                merged[key] = (round(median) if isinstance(value, int) and median is not None
                               else median)
        merged["first_error"] = next((c.first_error for c in group if c.first_error), "")
        out.append(CellResult(**merged))
    return out


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


_HEADER = (f"{'workload':8} {'target':15} {'req/s':>8} {'tok/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
           f"{'errors':>6} {'envoy ms/req':>12} {'epp ms/req':>10} {'-idle':>6} "
           f"{'sched p50/p99 ms':>17} {'loads/req':>9} {'engines ms/req':>14}")


def _row(c: CellResult) -> str:
    sched = (f"{_fmt(c.epp_scheduling_p50_ms)}/{_fmt(c.epp_scheduling_p99_ms)}"
             if c.epp_scheduling_p50_ms is not None else "-")
    return (f"{c.workload:8} {c.target:15} {c.requests_per_s:8.0f} {c.tokens_per_s:9.0f} "
            f"{c.p50_ms:8.1f} {c.p99_ms:8.1f} {c.errors:6d} "
            f"{_fmt(c.envoy_cpu_ms_per_request):>12} {_fmt(c.epp_cpu_ms_per_request):>10} "
            f"{_fmt(c.epp_cpu_ms_per_request_minus_idle, '.2f'):>6} {sched:>17} "
            f"{_fmt(c.epp_load_only_records_per_request, '.2f'):>9} "
            f"{_fmt(c.engines_cpu_ms_per_request):>14}")


def _table(cells: list[CellResult]) -> str:
    return "\n".join([_HEADER, *(_row(c) for c in cells)])


def _verdicts(cells: list[CellResult]) -> list[str]:
    by = {(c.workload, c.target): c for c in cells}
    lines = []
    rr = by.get(("stream", "envoy-rr"))
    for kv in (c for c in cells if c.workload == "stream" and c.target.startswith("kvswitch")):
        if rr and rr.tokens_per_s:
            ratio = kv.tokens_per_s / rr.tokens_per_s
            lines.append(f"streamed tok/s {kv.target} / Envoy RR = {ratio:.1%} (target >= 95%): "
                         f"{'met' if ratio >= 0.95 else 'NOT met'}")
    for target in sorted({c.target for c in cells if c.epp_cpu_ms_per_request is not None}):
        epp_costs = [c for c in cells
                     if c.target == target and c.epp_cpu_ms_per_request is not None]
        worst = max(epp_costs, key=lambda c: c.epp_cpu_ms_per_request or 0.0)
        total = worst.epp_cpu_ms_per_request or 0.0
        lines.append(f"{target}: EPP CPU per request = {total:.3f} ms "
                     f"({_fmt(worst.epp_cpu_ms_per_request_minus_idle)} ms minus idle), worst "
                     f"cell {worst.workload} (target <= 0.2 ms): "
                     f"{'met' if total <= 0.2 else 'NOT met'}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
