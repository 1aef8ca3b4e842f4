"""EPP CPU spent on engine telemetry (KV-event batches + EngineLoad records), before vs after.

Starts N `kvswitch engine` processes (simulated llama3-8b-h100, real-time clock by default) and
one `kvswitch epp` with the default profile over them, then drives a steady load *straight at
the engines* (a fixed number of in-flight requests per engine, shared-prefix prompts), so the
EPP schedules nothing and its CPU is the telemetry path: SubscribeKvEvents decode + index apply
+ load records, plus its light GetLoads polling. Measured over a window after a warm-up:
  epp_cpu_per_s     EPP process CPU seconds (user+sys, /proc) per wall second
  engine_cpu_per_s  the engines' CPU seconds per wall second, summed
  messages_per_s    KvEventBatch messages (batch numbers) engine 0 publishes per subscriber
  requests_per_s    requests the engines completed
  epp_cpu_ms_per_request  EPP CPU milliseconds per completed request (telemetry scales with work)
`--api sglang --page-size N` runs SGLang engines publishing N-token pages, which the EPP regroups
into its 16-token blocks (the engines' requests are then SGLang's). Each tree (`--tree
label=path`, e.g. a `git archive` of an older commit) runs engines and EPP from its own sources;
trees alternate within each round and medians over rounds are reported. Prints and saves JSON.

    git archive <commit> | tar -x -C /tmp/before
    .venv/bin/python benchmarks/epp_telemetry.py --tree before=/tmp/before --tree after=. \\
        --rounds 3 --out benchmarks/results/epp_telemetry.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

from kvswitch.epp.config import static_pool
from kvswitch.launcher import DEFAULT_EPP_CONFIG, free_port
from kvswitch.protocol import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc
from kvswitch.protocol.sglang import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

TICKS = os.sysconf("SC_CLK_TCK")



def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.1)
    raise RuntimeError(f"port {port} never opened (exit code {proc.poll()})")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def launch(tree: Path, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "kvswitch", *args], env=env, cwd="/",
                                stdout=out, stderr=subprocess.STDOUT)


def generate_request(api: str, request_id: str, ids: list[int]) -> object:
    if api == "sglang":
        s = sglang_scheduler_pb2
        return s.GenerateRequest(
            request_id=request_id, tokenized=s.TokenizedInput(input_ids=ids),
            sampling_params=s.SamplingParams(max_new_tokens=128, ignore_eos=True,
                                             temperature=1.0, top_p=1.0))
    return vllm_engine_pb2.GenerateRequest(
        request_id=request_id, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=128, ignore_eos=True))


def engine_stub(api: str, channel: grpc.aio.Channel) -> object:
    if api == "sglang":
        return sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


async def drive(addresses: list[str], per_engine: int, stop_at: float, seed: int,
                done: list[int], api: str = "vllm") -> None:
    """`per_engine` closed-loop clients per engine: 8 prefix groups of 1,024 tokens + 256."""
    rng = random.Random(seed)
    groups = [[rng.randrange(1000, 100_000) for _ in range(1024)] for _ in range(8)]

    async def client(stub: Any, n: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            ids = groups[rng.randrange(8)] + [rng.randrange(1000, 100_000) for _ in range(256)]
            request = generate_request(api, f"c{n}-{i}", ids)
            async for _ in stub.Generate(request, timeout=120):
                pass
            done[0] += 1
            i += 1

    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        await asyncio.gather(*(client(engine_stub(api, ch), e * 1000 + k)
                               for e, ch in enumerate(channels) for k in range(per_engine)))
    finally:
        for ch in channels:
            await ch.close()


async def follow_sequence(address: str, latest: list[int], api: str = "vllm") -> None:
    """Keeps `latest[0]` at the engine's last batch number (one per published batch)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub: Any = engine_stub(api, channel)
        call = stub.SubscribeKvEvents(
            common_pb2.SubscribeKvEventsRequest(start_sequence_number=0))
        try:
            async for batch in call:
                latest[0] = max(latest[0], batch.sequence_number)
        finally:
            call.cancel()


async def measure(pids: dict[str, list[int]], addresses: list[str], args: argparse.Namespace
                  ) -> dict[str, float]:
    start = time.monotonic()
    end = start + args.warmup + args.seconds
    done, latest = [0], [0]
    load = asyncio.create_task(drive(addresses, args.per_engine, end, args.seed, done, args.api))
    probe = asyncio.create_task(follow_sequence(addresses[0], latest, args.api))
    await asyncio.sleep(args.warmup)
    cpu0 = {k: sum(cpu_seconds(p) for p in v) for k, v in pids.items()}
    done0, seq0, t0 = done[0], latest[0], time.monotonic()
    await asyncio.sleep(args.seconds)
    wall = time.monotonic() - t0
    cpu1 = {k: sum(cpu_seconds(p) for p in v) for k, v in pids.items()}
    done1, seq1 = done[0], latest[0]
    probe.cancel()
    with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
        await probe
    await load
    return {"epp_cpu_per_s": (cpu1["epp"] - cpu0["epp"]) / wall,
            "engine_cpu_per_s": (cpu1["engines"] - cpu0["engines"]) / wall,
            "messages_per_s": (seq1 - seq0) / wall,
            "requests_per_s": (done1 - done0) / wall,
            # Throughput varies with the machine's other load: CPU per request compares better.
            "epp_cpu_ms_per_request": (cpu1["epp"] - cpu0["epp"]) / max(done1 - done0, 1) * 1e3}


def run_once(tree: Path, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    ports = [free_port() for _ in range(args.engines)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    (tmp / "config.yaml").write_text(yaml.safe_dump(DEFAULT_EPP_CONFIG, sort_keys=False))
    (tmp / "pool.yaml").write_text(yaml.safe_dump_all(static_pool(addresses, api=args.api)))
    api_args = ["--api", args.api, "--page-size", str(args.page_size)] \
        if args.api == "sglang" else []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, port in enumerate(ports):
            procs.append(launch(tree, ["engine", "--port", str(port), "--profile", args.profile,
                                       "--time-scale", str(args.time_scale), "--mode", "random",
                                       "--log-level", "WARNING", *api_args],
                               tmp / f"engine{i}.log"))
        for port, proc in zip(ports, procs, strict=True):
            wait_port(port, proc)
        epp_port, metrics_port = free_port(), free_port()
        epp = launch(tree, ["epp", "--config", str(tmp / "config.yaml"),
                            "--pool", str(tmp / "pool.yaml"), "--port", str(epp_port),
                            "--metrics-port", str(metrics_port)], tmp / "epp.log")
        procs.append(epp)
        wait_port(epp_port, epp)
        time.sleep(1.0)  # subscriptions open
        pids = {"epp": [epp.pid], "engines": [p.pid for p in procs[:-1]]}
        return asyncio.run(measure(pids, addresses, args))
    finally:
        for proc in reversed(procs):
            stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", default=[],
                        help="label=path of a source tree (repeatable; default after=.)")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--per-engine", type=int, default=16, help="in-flight requests")
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api", choices=["vllm", "sglang"], default="vllm")
    parser.add_argument("--page-size", type=int, default=1,
                        help="--api sglang: the engines' radix-cache page size")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/epp_telemetry.json"))
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"after": "."}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
    for r in range(args.rounds):
        for label, path in trees.items():
            for attempt in range(3):  # a port taken between pick and bind: start over
                with tempfile.TemporaryDirectory() as tmp:
                    try:
                        result = run_once(Path(path), args, Path(tmp))
                        break
                    except RuntimeError as exc:
                        print(f"round {r} {label}: {exc}; retrying", flush=True)
            else:
                raise SystemExit(f"round {r} {label}: could not start")
            runs[label].append(result)
            print(f"round {r} {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()),
                  flush=True)
    medians = {label: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
               for label, rs in runs.items()}
    for label, m in medians.items():
        print(f"median {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
    load = os.getloadavg()
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "trees": trees,
              "loadavg_at_end": load, "runs": runs, "medians": medians}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
