"""Micro-benchmark (not a test): scheduler steps/s with 1,000 running sequences, and the whole
SimEngine streaming to 1,000 concurrent consumers.

    .venv/bin/python tests/engine/sim/bench_scheduler.py
"""

from __future__ import annotations

import asyncio
import json
import time

from kvswitch.engine.base import GenerationRequest, SamplingOptions
from kvswitch.engine.sim import SimConfig, SimEngine


def bench_scheduler(num_seqs: int = 1000, steps: int = 300) -> dict[str, float]:
    engine = SimEngine(SimConfig(time_scale=1e9))
    sched = engine.scheduler
    engine._running = True  # build requests without starting the loop
    for i in range(num_seqs):
        prompt = [(i * 131 + j) % 150000 for j in range(64)]
        engine._admit(GenerationRequest(f"b{i}", prompt, SamplingOptions(max_tokens=4000)), prompt)
    while sched.waiting:  # prefill everything first
        sched.step()
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        r = sched.step()
        tokens += len(r.outputs)
        for seq in r.outputs:  # what the engine does per token
            seq.owner.stream.push(seq, 0.0)
        for req in engine._requests.values():
            req.stream.pending = None
    dt = time.perf_counter() - t0
    return {"running": len(sched.running), "steps_per_s": steps / dt, "tokens_per_s": tokens / dt}


async def bench_engine(num_streams: int = 1000, max_tokens: int = 200) -> dict[str, float]:
    engine = SimEngine(SimConfig(time_scale=1e9))
    await engine.start()

    async def one(i: int) -> int:
        prompt = [(i * 131 + j) % 150000 for j in range(64)]
        n = 0
        async for u in engine.generate(
            GenerationRequest(f"e{i}", prompt, SamplingOptions(max_tokens=max_tokens))
        ):
            n += sum(len(s.token_ids) for s in u.sequences)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(num_streams)))
    dt = time.perf_counter() - t0
    await engine.stop()
    return {"streams": num_streams, "tokens_per_s": sum(counts) / dt, "seconds": dt}


if __name__ == "__main__":
    print(
        json.dumps(
            {"scheduler": bench_scheduler(), "engine": asyncio.run(bench_engine())}, indent=1
        )
    )
