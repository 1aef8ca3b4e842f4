"""OpenAI-over-HTTP transcoding throughput: `kvswitch frontend` vs SMG on the same engine pool.

One run starts `--engines` simulated engines (random mode, huge time scale, so the model is not
the bottleneck), then, one at a time, each gateway in front of the whole pool:

  kvswitch: `kvswitch frontend --target ipv4:127.0.0.1:P1,127.0.0.1:P2 --workers W`
            (gRPC round robin over the pool, no Envoy: this measures the transcoder alone)
  smg:      `smg launch --worker-urls grpc://127.0.0.1:P1 grpc://... --policy round_robin`

(with `--rounds R`, the targets take turns R times, so a noisy shared machine hits them alike)
and drives it from a separate process with `--concurrency` streamed chat completions in flight
(max_tokens = `--output-tokens`, ignore_eos), over a minimal asyncio HTTP/1.1 client (keep-alive,
chunked SSE; the OpenAI SDK would be the bottleneck). It reports output tokens/s (from the usage
chunk), requests/s, TTFT p50/p99 (first non-empty content delta), and the gateway's and engines'
CPU per output token (/proc/PID/stat, gateway process tree). Prints a table and saves JSON.

    .venv/bin/python benchmarks/frontend_throughput.py --duration 15 --out frontend.json
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvswitch.tokenization import bundled_tokenizer_dir

CLK_TCK = os.sysconf("SC_CLK_TCK")
# SMG streams Qwen3's output as reasoning_content (its reasoning parser); both count.
_CONTENT = re.compile(rb'content":"[^"]')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')


@dataclass
class ClientResult:
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    first_error: str = ""


@dataclass
class Cell:
    target: str
    concurrency: int
    seconds: float
    requests: int
    errors: int
    output_tokens: int
    tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    gateway_cpu_us_per_token: float
    gateway_cpu_cores: float
    engines_cpu_cores: float
    first_error: str = ""
    command: str = ""


# --- a minimal HTTP/1.1 + SSE client ------------------------------------------------------

async def _one_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       request: bytes, result: ClientResult) -> bool:
    """One streamed completion on a kept-alive connection; False if the connection is done."""
    started = time.perf_counter()
    writer.write(request)
    status_line = await reader.readline()
    if not status_line:
        return False
    status = int(status_line.split()[1])
    chunked, length = False, None
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        name = name.strip().lower()
        if name == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
        elif name == "content-length":
            length = int(value.strip())
    first = True
    tokens = 0
    tail = b""
    body_parts = []
    if chunked:
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            data = await reader.readexactly(size + 2)
            if first and _CONTENT.search(data):
                result.ttfts.append(time.perf_counter() - started)
                first = False
            tail = (tail + data)[-4096:]
            if status != 200:
                body_parts.append(data)
    elif length is not None:
        data = await reader.readexactly(length)
        tail, body_parts = data, [data]
    match = None
    for match in _COMPLETION_TOKENS.finditer(tail):
        pass
    if status != 200 or match is None:
        result.errors += 1
        if not result.first_error:
            result.first_error = f"HTTP {status}: {b''.join(body_parts)[:300]!r}"
        return True
    tokens = int(match.group(1))
    result.requests += 1
    result.tokens += tokens
    return True


async def _worker(host: str, port: int, body: bytes, deadline: float,
                  result: ClientResult) -> None:
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
               "Accept: text/event-stream\r\n\r\n").encode() + body
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.monotonic() < deadline:
            if not await _one_request(reader, writer, request, result):
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
    finally:
        writer.close()


def _client_process(port: int, model: str, concurrency: int, seconds: float,
                    output_tokens: int, queue: Any) -> None:
    async def main() -> ClientResult:
        result = ClientResult()
        deadline = time.monotonic() + seconds
        tasks = []
        for i in range(concurrency):
            body = json.dumps({
                "model": model, "stream": True, "max_tokens": output_tokens,
                "ignore_eos": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"client {i}: tell me a story"}],
            }).encode()
            tasks.append(_worker("127.0.0.1", port, body, deadline, result))
        await asyncio.gather(*tasks, return_exceptions=False)
        return result
    queue.put(asdict(asyncio.run(main())))


def drive(port: int, model: str, concurrency: int, seconds: float,
          output_tokens: int) -> ClientResult:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_client_process,
                       args=(port, model, concurrency, seconds, output_tokens, queue))
    proc.start()
    data = queue.get(timeout=seconds + 120)
    proc.join(timeout=30)
    return ClientResult(**data)


# --- processes ----------------------------------------------------------------------------

def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def _tree_cpu(pids: list[int]) -> float:
    return sum(_cpu_seconds(p) for root in pids for p in _tree(root))


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(port: int, path: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"port {port}{path} not ready in {timeout}s")


def _wait_port(port: int, timeout: float) -> None:
    import socket
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"port {port} not open in {timeout}s")


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        for pid in reversed(_tree(proc.pid)):  # children first, each by its own pid
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_serving(port: int, model: str, timeout: float) -> None:
    """Until one chat completion succeeds (SMG registers the tokenizer after /v1/models)."""
    import urllib.error
    import urllib.request
    body = json.dumps({"model": model, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def run_cell(name: str, argv: list[str], port: int, engines: list[subprocess.Popen[bytes]],
             args: argparse.Namespace, logs: Path) -> Cell:
    proc = _start(argv, logs / f"{name}.log")
    try:
        _wait_port(port, 120)
        _wait_http(port, "/v1/models", 120, proc)
        model = json.loads(__import__("urllib.request").request.urlopen(
            f"http://127.0.0.1:{port}/v1/models").read())["data"][0]["id"]
        _wait_serving(port, model, 120)
        drive(port, model, args.concurrency, args.warmup, args.output_tokens)
        gw_before = _tree_cpu([proc.pid])
        eng_before = _tree_cpu([e.pid for e in engines])
        started = time.monotonic()
        result = drive(port, model, args.concurrency, args.duration, args.output_tokens)
        seconds = time.monotonic() - started
        gw_cpu = _tree_cpu([proc.pid]) - gw_before
        eng_cpu = _tree_cpu([e.pid for e in engines]) - eng_before
    except BaseException:
        print((logs / f"{name}.log").read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        _stop(proc)
    ttfts = sorted(result.ttfts)
    return Cell(
        target=name, concurrency=args.concurrency, seconds=round(seconds, 2),
        requests=result.requests, errors=result.errors, output_tokens=result.tokens,
        tokens_per_s=round(result.tokens / seconds, 1),
        requests_per_s=round(result.requests / seconds, 1),
        ttft_p50_ms=round(statistics.median(ttfts) * 1e3, 2) if ttfts else float("nan"),
        ttft_p99_ms=round(ttfts[int(len(ttfts) * 0.99) - 1] * 1e3, 2) if ttfts else float("nan"),
        gateway_cpu_us_per_token=round(gw_cpu / result.tokens * 1e6, 2) if result.tokens else 0,
        gateway_cpu_cores=round(gw_cpu / seconds, 2),
        engines_cpu_cores=round(eng_cpu / seconds, 2),
        first_error=result.first_error, command=shown_command(argv))


def shown_command(argv: list[str]) -> str:
    """The command as a result file records it: executables by name, the tokenizer copy (a
    temporary directory) by what it is, so no path of the measuring machine is kept."""
    shown = [Path(argv[0]).name, *argv[1:]]
    for i, arg in enumerate(shown[:-1]):
        if arg in ("--tokenizer", "--tokenizer-path"):
            shown[i + 1] = "<the Qwen3 tokenizer directory>"
    return " ".join(shown)


def tokenizer_dir(directory: Path) -> Path:
    """kvswitch's bundled Qwen3 tokenizer, copied to `directory` with tokenizer.json unpacked:
    SMG's `--tokenizer-path` reads a plain tokenizer.json."""
    shutil.copytree(bundled_tokenizer_dir(), directory)
    packed = directory / "tokenizer.json.gz"
    (directory / "tokenizer.json").write_bytes(gzip.decompress(packed.read_bytes()))
    packed.unlink()
    return directory


def _targets(args: argparse.Namespace, engine_ports: list[int], tokenizer: Path
             ) -> list[tuple[str, Callable[[int], list[str]]]]:
    """(name, argv for a port) of every gateway to measure."""
    pool = ",".join(f"127.0.0.1:{p}" for p in engine_ports)
    out: list[tuple[str, Callable[[int], list[str]]]] = []
    if "kvswitch" in args.targets:
        for workers in args.workers:
            out.append((f"kvswitch-frontend-w{workers}", lambda port, workers=workers: [
                sys.executable, "-m", "kvswitch", "frontend", "--target", f"ipv4:{pool}",
                "--port", str(port), "--workers", str(workers),
                "--tokenizer", str(tokenizer), "--log-level", "warning"]))
    smg = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
    if "smg" in args.targets and Path(smg).exists():
        out.append(("smg", lambda port: [
            smg, "launch", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *[f"grpc://127.0.0.1:{p}" for p in engine_ports],
            "--policy", "round_robin", "--tokenizer-path", str(tokenizer),
            "--log-level", "warn"]))
    elif "smg" in args.targets:
        print("smg is not installed (pip install smg); skipped", file=sys.stderr)
    return out


def _summary(cells: list[Cell]) -> dict[str, dict[str, float]]:
    """Per target, the median over rounds of tokens/s and gateway CPU per token."""
    by_target: dict[str, list[Cell]] = {}
    for cell in cells:
        by_target.setdefault(cell.target, []).append(cell)
    return {name: {"cells": len(group),
                   "tokens_per_s": round(statistics.median(c.tokens_per_s for c in group), 1),
                   "gateway_cpu_us_per_token": round(statistics.median(
                       c.gateway_cpu_us_per_token for c in group), 2)}
            for name, group in by_target.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="kvswitch frontend --workers values to measure")
    parser.add_argument("--targets", nargs="+", default=["kvswitch", "smg"])
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every target this many times, interleaved")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    logs = Path(tempfile.mkdtemp(prefix="kvswitch-frontend-bench-"))
    tokenizer = tokenizer_dir(logs / "tokenizer")
    engine_ports = [_free_port() for _ in range(args.engines)]
    engines = [_start([sys.executable, "-m", "kvswitch", "engine", "--port", str(p),
                       "--mode", "random", "--time-scale", "1000000", "--max-num-seqs", "1000",
                       "--num-gpu-blocks", "200000", "--log-level", "WARNING"],
                      logs / f"engine-{p}.log") for p in engine_ports]
    cells: list[Cell] = []
    try:
        for p in engine_ports:
            _wait_port(p, 120)
        for _ in range(args.rounds):
            for name, command in _targets(args, engine_ports, tokenizer):
                port = _free_port()  # just before it is used: earlier, a client could take it
                cells.append(run_cell(name, command(port), port, engines, args, logs))
                print(json.dumps(asdict(cells[-1])), flush=True)
    finally:
        for engine in engines:
            _stop(engine)

    header = f"{'target':<24}{'tok/s':>10}{'req/s':>8}{'TTFT p50':>10}{'p99 ms':>8}" \
             f"{'gw us/tok':>11}{'gw cores':>10}{'eng cores':>10}{'errors':>8}"
    print(header)
    for c in cells:
        print(f"{c.target:<24}{c.tokens_per_s:>10.0f}{c.requests_per_s:>8.1f}"
              f"{c.ttft_p50_ms:>10.1f}{c.ttft_p99_ms:>8.1f}{c.gateway_cpu_us_per_token:>11.1f}"
              f"{c.gateway_cpu_cores:>10.2f}{c.engines_cpu_cores:>10.2f}{c.errors:>8}")
    summary = _summary(cells)
    for name, row in summary.items():
        print(f"{name:<24} median of {row['cells']}: {row['tokens_per_s']:.0f} tok/s, "
              f"{row['gateway_cpu_us_per_token']:.1f} us/tok")
    report = {"machine_cpus": os.cpu_count(), "engines": args.engines,
              "concurrency": args.concurrency, "output_tokens": args.output_tokens,
              "duration_s": args.duration, "rounds": args.rounds, "summary": summary,
              "cells": [asdict(c) for c in cells], "logs": str(logs)}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
