"""Streaming throughput of one `kvswitch engine` process (servicer + simulator on one core).

Starts `kvswitch engine`, pins it to one core, and drives it from client processes pinned to
the other cores, each keeping many streaming Generate calls in flight (long outputs,
ignore_eos). After a warm-up in which every stream gets admitted, it counts streamed tokens and
messages over the measured window, samples GetServerInfo.active_requests (concurrent streams
sustained) and reads the engine's CPU seconds from /proc/PID/stat. Prints and saves JSON.

Time scale: at 1 (default) the llama3-8b-h100 profile asks for ~85k tokens/s from 1,000
streams, more than one core can simulate and stream, so the engine runs CPU-bound, which is
what this measures. A huge time scale (--time-scale 1e6) makes each stream finish in well under
a second; grpc.aio then has to admit new streams faster than it can while hundreds stream
(~40/s measured), so concurrency never builds up: use it with short --max-tokens to measure the
request rate instead.

    .venv/bin/python benchmarks/engine_throughput.py            # 1,000 streams, ~45 s
    .venv/bin/python benchmarks/engine_throughput.py --concurrency 200 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from kvswitch.launcher import free_port
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol import vllm_engine_pb2_grpc

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat (fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK



async def _client(target: str, streams: int, channels: int, max_tokens: int, prompt_len: int,
                  warmup: float, duration: float, worker: int) -> dict[str, float]:
    chans = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(channels)]
    stubs = [vllm_engine_pb2_grpc.VllmEngineStub(c) for c in chans]
    start = time.monotonic()
    measure_from, stop_at = start + warmup, start + warmup + duration
    totals = {"tokens": 0, "messages": 0, "requests": 0, "errors": 0}

    async def loop(i: int) -> None:
        stub = stubs[i % len(stubs)]
        n = 0
        # Open streams gradually over most of the warm-up: grpc.aio admits new streams slowly
        # while many stream, and a call left unadmitted for 30 s is cancelled by gRPC core.
        await asyncio.sleep(warmup * 0.8 * i / max(streams, 1))
        while time.monotonic() < stop_at:
            n += 1
            request = pb.GenerateRequest(
                request_id=f"w{worker}-{i}-{n}", stream=True,
                tokenized=pb.TokenizedInput(input_ids=[(i * 7 + k) % 50_000 + 1
                                                       for k in range(prompt_len)]),
                sampling_params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            call = stub.Generate(request)
            try:
                async for response in call:
                    now = time.monotonic()
                    if now >= stop_at:
                        call.cancel()
                        break
                    if now >= measure_from and response.WhichOneof("response") == "chunk":
                        # Counted as they stream: at time scale 1 a request outlives the window.
                        totals["tokens"] += len(response.chunk.token_ids)
                        totals["messages"] += 1
                else:
                    if measure_from <= time.monotonic() <= stop_at:
                        totals["requests"] += 1
            except grpc.aio.AioRpcError as exc:
                if measure_from <= time.monotonic() <= stop_at:
                    totals["errors"] += 1
                    if totals["errors"] <= 3:
                        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)

    await asyncio.gather(*(loop(i) for i in range(streams)))
    for c in chans:
        await c.close()
    return {k: float(v) for k, v in totals.items()}


def _client_main(args: tuple, cpus: set[int], out: mp.Queue) -> None:  # type: ignore[type-arg]
    if cpus:
        os.sched_setaffinity(0, cpus)
    # As in the engine: let grpc.aio's poller thread take the GIL promptly.
    sys.setswitchinterval(0.0002)
    try:
        import uvloop
        result = uvloop.run(_client(*args))
    except ImportError:
        result = asyncio.run(_client(*args))
    out.put(result)


async def _sample_active(target: str, until: float, start_at: float) -> list[int]:
    samples: list[int] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        while time.monotonic() < until:
            info = await stub.GetServerInfo(pb.GetServerInfoRequest())
            if time.monotonic() >= start_at:
                samples.append(info.active_requests)
            await asyncio.sleep(0.25)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=1000, help="streams kept in flight")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--channels", type=int, default=4, help="gRPC channels per client")
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens per request")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--duration", type=float, default=15.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=30.0,
                        help="unmeasured seconds first (every stream gets accepted)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="engine --time-scale (see the module docstring)")
    parser.add_argument("--engine-cpu", type=int, default=0, help="core to pin the engine to")
    parser.add_argument("--out", default="benchmarks/results/engine_throughput.json",
                        help="where to save the JSON result")
    parser.add_argument("--target", default=None,
                        help="measure an already running engine at HOST:PORT instead")
    args = parser.parse_args()

    all_cpus = sorted(os.sched_getaffinity(0))
    engine_cpus = {args.engine_cpu} if args.engine_cpu in all_cpus else set()
    client_cpus = set(all_cpus) - engine_cpus or set(all_cpus)
    engine = None
    if args.target is None:
        port = free_port()
        target = f"127.0.0.1:{port}"
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        # The engine's log goes to a temporary file: nothing to keep next to the results.
        log = tempfile.NamedTemporaryFile("w", prefix="kvswitch-engine-",  # noqa: SIM115
                                          suffix=".log", delete=False)
        engine = subprocess.Popen(
            [sys.executable, "-m", "kvswitch", "engine", "--port", str(port),
             "--time-scale", str(args.time_scale),
             "--max-num-seqs", str(max(args.concurrency, 256)),
             "--num-gpu-blocks", str(_blocks_needed(args)),
             "--max-model-len", str(args.prompt_len + args.max_tokens + 16),
             "--log-level", "WARNING"], stdout=log, stderr=subprocess.STDOUT)
        if engine_cpus:
            os.sched_setaffinity(engine.pid, engine_cpus)
        _wait_ready(target, engine)
    else:
        target = args.target

    per_client = [args.concurrency // args.clients + (1 if i < args.concurrency % args.clients
                                                      else 0) for i in range(args.clients)]
    queue: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    procs = [mp.Process(target=_client_main, args=(
        (target, n, args.channels, args.max_tokens, args.prompt_len, args.warmup,
         args.duration, i), client_cpus, queue)) for i, n in enumerate(per_client)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    measure_start = t0 + args.warmup
    time.sleep(max(0.0, measure_start - time.monotonic()))
    cpu0 = cpu_seconds(engine.pid) if engine else 0.0
    wall0 = time.monotonic()
    active = asyncio.run(_sample_active(target, measure_start + args.duration, measure_start))
    cpu1 = cpu_seconds(engine.pid) if engine else 0.0
    wall1 = time.monotonic()
    results = [queue.get(timeout=args.duration + 120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    if engine is not None:
        engine.terminate()
        engine.wait(timeout=60)

    tokens = sum(r["tokens"] for r in results)
    messages = sum(r["messages"] for r in results)
    elapsed = wall1 - wall0
    summary = {
        "target": target,
        "concurrency": args.concurrency,
        "client_processes": args.clients,
        "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len,
        "time_scale": args.time_scale,
        "duration_s": round(elapsed, 2),
        "tokens_per_s": round(tokens / elapsed, 1),
        "messages_per_s": round(messages / elapsed, 1),
        "tokens_per_message": round(tokens / messages, 2) if messages else 0.0,
        "requests_per_s": round(sum(r["requests"] for r in results) / elapsed, 1),
        "errors": int(sum(r["errors"] for r in results)),
        "active_streams_mean": round(statistics.fmean(active), 1) if active else None,
        "active_streams_min": min(active) if active else None,
        "active_streams_max": max(active) if active else None,
        "engine_cpu_s": round(cpu1 - cpu0, 2) if engine else None,
        "engine_cpu_utilization": round((cpu1 - cpu0) / elapsed, 3) if engine else None,
        "engine_cpu_us_per_token": round((cpu1 - cpu0) / tokens * 1e6, 2)
        if engine and tokens else None,
        "engine_pinned_cpus": sorted(engine_cpus),
        "client_cpus": sorted(client_cpus),
    }
    print(json.dumps(summary, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _blocks_needed(args: argparse.Namespace) -> int:
    # Every stream's whole sequence fits at once, so the run measures streaming, not preemption.
    per_stream = (args.prompt_len + args.max_tokens) // 16 + 2
    return max(10_000, args.concurrency * per_stream * 5 // 4)


def _wait_ready(target: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}")
        try:
            with grpc.insecure_channel(target) as channel:
                vllm_engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(
                    pb.HealthCheckRequest(), timeout=1.0)
                return
        except grpc.RpcError:
            time.sleep(0.2)
    raise TimeoutError("engine did not become ready")


if __name__ == "__main__":
    raise SystemExit(main())
