"""Run one target on one workload: open-loop Poisson sends at simulated times, bounded.

Every request is sent at `send_at / time_scale` wall seconds after the start, whatever the
responses do (open loop, like inference-perf), through the target's `choose`; a conversation's
next turn (`BenchRequest.previous`) also waits for its previous turn to end, as inference-perf's
user sessions do, and asks for its answer (`answer_ids`) as structured output. The run ends when
every request has finished, or `drain_timeout` wall seconds after the last send (stragglers are
cancelled and count as failures), so it always stops by itself. Engine counters are read before
and after; their deltas give the cache hit rate and the per-replica load. The engines' request
logs are read after the run: every request that arrived at an engine from the run's start
(`start_wall`) on, timed by the engine itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from kvswitch.bench.client import Channels, RequestResult, generate_request, send
from kvswitch.bench.contracts import RunContext, Target
from kvswitch.bench.cpu import CpuMonitor
from kvswitch.bench.engines import EngineCounters, deltas
from kvswitch.bench.workloads import BenchRequest, Workload, answer_text
from kvswitch.engine.request_log import RequestRecord


@dataclass(frozen=True)
class TargetRun:
    target: str
    results: tuple[RequestResult, ...]
    counters: dict[str, EngineCounters]
    """Per engine address: counter deltas over the run."""
    wall_seconds: float
    unavailable: str = ""
    """Non-empty when the target could not run (the reason)."""
    cpu: dict[str, Any] = dataclasses.field(default_factory=dict)
    """`CpuMonitor.summary()` over the run: load, machine busy cores, cores per process."""
    engine_records: dict[str, tuple[RequestRecord, ...]] = dataclasses.field(
        default_factory=dict)
    """Per engine address: its request-log records of the requests that arrived during the run."""
    start_wall: float = 0.0
    """time.time() when the run's clock started (send_at 0)."""
    stream: bool = True
    """Whether requests asked for streamed output."""


async def run_target(target: Target, workload: Workload, ctx: RunContext, time_scale: float,
                     drain_timeout: float = 120.0, request_timeout: float = 600.0,
                     progress: bool = True, stream: bool = True) -> TargetRun:
    await target.start(ctx)
    # Flush after the target is up (SMG warms up with a request): every target starts cold.
    flushed = await ctx.pool.flush()
    if not all(flushed.values()):
        await target.stop()
        raise RuntimeError(f"FlushCache failed on {[a for a, ok in flushed.items() if not ok]}")
    channels = Channels(api=ctx.pool.api)
    run_id = uuid.uuid4().hex[:8]
    try:
        if not hasattr(target, "send_request"):
            await channels.connect(target.addresses())
        before = await ctx.pool.counters()
        ctx.pool.new_records()  # skip what earlier targets (and warm-ups) left in the logs
        monitor = CpuMonitor(lambda: [(c.name, c.pid) for c in ctx.supervisor.children
                                      if c.alive()])
        monitor.start()
        started, start_wall = time.perf_counter(), time.time()
        try:
            results = await _drive(target, workload, channels, run_id, time_scale,
                                   drain_timeout, request_timeout, progress, stream, started)
        finally:
            cpu = await monitor.stop()
        wall = time.perf_counter() - started
        await asyncio.sleep(0.2)  # the engines' last counter updates
        after = await ctx.pool.counters()
        records = await ctx.pool.records_since(start_wall, sum(r.ok for r in results))
    finally:
        await channels.close()
        await target.stop()
    return TargetRun(target.name, tuple(results), deltas(after, before), wall, cpu=cpu,
                     engine_records={a: tuple(r) for a, r in records.items()},
                     start_wall=start_wall, stream=stream)


async def _drive(target: Target, workload: Workload, channels: Channels, run_id: str,
                 time_scale: float, drain_timeout: float, request_timeout: float,
                 progress: bool, stream: bool, t0: float) -> list[RequestResult]:
    requests = workload.requests
    bar = tqdm(total=len(requests), desc=f"{target.name:>16}", unit="req", disable=not progress,
               leave=True, dynamic_ncols=True)
    results: list[RequestResult] = []

    # A conversation's next turn is sent when its previous turn has ended, if that is later.
    ended = {r.previous: asyncio.Event() for r in requests if r.previous >= 0}

    async def one(request: BenchRequest) -> None:
        try:
            if request.previous >= 0:
                await ended[request.previous].wait()
            sent = time.perf_counter()
            address, endpoint = target.choose(request)
            text = workload.text(request) if target.text_prompts else None
            answer = answer_text(request, workload.tokenizer)
            http_send = getattr(target, "send_request", None)
            if http_send is not None:  # an OpenAI HTTP target (SMG)
                result = await http_send(request, text or workload.text(request), time_scale,
                                         request_timeout, stream, answer)
            else:
                message = generate_request(request, run_id, text, stream, channels.api, answer)
                result = await send(channels.stub(address), message, request, time_scale,
                                    request_timeout, endpoint,
                                    lambda: target.first_token(request))
            target.finished(request, result)
            results.append(dataclasses.replace(result, sent_at=(sent - t0) * time_scale))
            bar.update(1)
        finally:
            if request.index in ended:
                ended[request.index].set()

    tasks: list[asyncio.Task[None]] = []
    try:
        for request in requests:
            delay = request.send_at / time_scale - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        bar.close()
    done = {r.index for r in results}
    for request in requests:
        if request.index not in done:
            results.append(RequestResult(request.index, request.stage, request.qps, ok=False,
                                         error="not finished before the drain timeout"))
    results.sort(key=lambda r: r.index)
    return results
