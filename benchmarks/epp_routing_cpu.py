"""CPU per routed request and per KV-event batch of the EPP, in process (no network).

Two measurements, each over many iterations with `time.process_time`:

- routing: `EppRouter.route()` + `request_finished()` with `kvswitch up`'s default profile
  (`kvswitch.launcher.DEFAULT_EPP_CONFIG` of the checkout it runs in) over 4 and 16 endpoints
  with varied load, for 128- and 1k-token tokenized prompts (a shared prefix per group + a unique
  tail, as in benchmarks/epp_scheduling.py), packed as the vllmgrpc parser hands them over
  (splitting them into blocks is routing's work; parsing is not measured here). The precise
  index knows every endpoint (as when subscribed) but gets no events here, so matches come
  from the speculative entries of earlier picks. No subscription is opened. A fifth case
  (4 endpoints, 128 tokens) feeds the index what the engines would report: 3 in 4 requests'
  blocks stored, the rest expiring unconfirmed after the 2 s speculative TTL.
- kv_events: `batch_from_proto()` + `KvBlockIndex.apply()` per `KvEventBatch` message as the
  simulated engine sends them (one `KvBlocksStored` per request: 9 blocks of 16 tokens for a
  128-token prompt + 16 output tokens, a `KvBlocksRemoved` evicting as many older blocks in steady
  state, an `EngineLoad` record), with 1 and 6 requests per batch.
- engine_batches: how many batches per second one simulated engine publishes at the gateway
  benchmark's per-engine load (125 req/s, 8 in flight, time scale 10000).

Each case runs `--rounds` times and the round with the least CPU is reported (the machine's
other work only ever adds). Prints and saves JSON.

    .venv/bin/python benchmarks/epp_routing_cpu.py --out benchmarks/results/epp_routing_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvswitch.engine.kv_events import load_record, to_int64
from kvswitch.epp.config import build_endpoint_picker, static_pool
from kvswitch.epp.contracts import InferenceRequest, ParsedBody, RequestOutcome
from kvswitch.epp.datalayer import Metrics
from kvswitch.epp.kvindex import BlocksStored, KvBlockIndex, KvEventBatchView, batch_from_proto
from kvswitch.epp.metrics import EppMetrics
from kvswitch.epp.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvswitch.epp.router import EppRouter
from kvswitch.launcher import DEFAULT_EPP_CONFIG
from kvswitch.protocol import common_pb2
from kvswitch.protocol.packed import PackedTokenIds, pack_token_ids

PATH = "/vllm.grpc.engine.VllmEngine/Generate"


def make_router(endpoints: int, rnd: random.Random) -> EppRouter:
    addresses = [f"10.0.0.{i + 1}:8000" for i in range(endpoints)]
    router = build_endpoint_picker(DEFAULT_EPP_CONFIG, static_pool(addresses),
                                   metrics=EppMetrics()).router
    assert isinstance(router, EppRouter)
    datalayer = router.datalayer
    datalayer.set_endpoints(router.refresher.discovery.endpoints)  # type: ignore[union-attr]
    datalayer.staleness = 1e9
    for a in addresses:
        datalayer.update(a, Metrics(running=rnd.randrange(20), waiting=rnd.randrange(4),
                                    kv_usage=rnd.random() * 0.7, max_tokens=29205 * 16,
                                    block_size=16, updated_at=datalayer.clock()))
    for plugin in router.scheduler.plugins:
        if isinstance(plugin, PrecisePrefixCacheScorer):
            plugin._following = plugin._pool()  # no grpc subscriptions in a CPU benchmark
            for a in addresses:
                plugin.index.add_endpoint(a)
    return router


def report_stored(index: KvBlockIndex, address: str, tokens: Sequence[int]) -> None:
    """What the engine at `address` would report after the prefill: the prompt's full blocks
    it did not hold yet (its own hash stands in for the engine's block hash)."""
    size = index.block_size
    hashes = index.block_hashes(tokens)
    first = next((i for i, h in enumerate(hashes) if not index.holds_really(address, h)),
                 len(hashes))
    blocks = tuple((hashes[i], pack_token_ids(tokens[i * size:(i + 1) * size]))
                   for i in range(first, len(hashes)))
    if blocks:
        index.apply(address, [BlocksStored(blocks, hashes[first - 1] if first else None, size)])


async def routing_cost(endpoints: int, prompt_tokens: int, requests: int, warmup: int,
                       seed: int, events: bool = False) -> dict[str, object]:
    """With `events`, the picked engine reports the blocks of 3 in 4 requests stored (not
    timed; the 4th never reaches prefill) and the index's clock advances 1 ms per request, so
    the speculative entries are confirmed or, after 2 s, expire unconfirmed."""
    rnd = random.Random(seed)
    router = make_router(endpoints, rnd)
    index = next(p.index for p in router.scheduler.plugins
                 if isinstance(p, PrecisePrefixCacheScorer))
    if events:
        ticks = iter(range(1 << 62))
        index.clock = lambda: next(ticks) * 0.0005  # read about twice per request
    prefix = prompt_tokens * 3 // 4
    prefixes = [tuple(rnd.randrange(150_000) for _ in range(prefix)) for _ in range(32)]
    tails = [tuple(rnd.randrange(150_000) for _ in range(prompt_tokens - prefix - 1))
             for _ in range(64)]
    # Packed, as the vllmgrpc parser hands a tokenized prompt over.
    built = [InferenceRequest(f"r{i}", "grpc", PATH, ParsedBody(
        prompt_token_ids=PackedTokenIds.of(rnd.choice(prefixes) + tails[i % len(tails)] + (i,))))
        for i in range(requests + warmup)]
    # Requests finish in the order they were routed, `in_flight` later (as under load).
    in_flight: deque[tuple[InferenceRequest, RequestOutcome]] = deque()
    cpu = 0.0
    for i, request in enumerate(built):
        c0 = time.process_time()
        decision = await router.route(request, None)
        in_flight.append((request, RequestOutcome(decision.endpoints[0], ok=True,
                                                  prompt_tokens=prompt_tokens,
                                                  completion_tokens=16)))
        if len(in_flight) > 8:
            router.request_finished(*in_flight.popleft())
        c1 = time.process_time()
        if i >= warmup:
            cpu += c1 - c0
        if events and i % 4:
            tokens = request.body.prompt_token_ids
            assert tokens is not None
            report_stored(index, decision.endpoints[0], tokens)
    return {"endpoints": endpoints, "prompt_tokens": prompt_tokens, "requests": requests,
            "kv_events": "3 in 4 requests confirmed" if events else "none",
            "cpu_us_per_request": cpu / requests * 1e6}


def _load() -> common_pb2.EngineLoad:
    from kvswitch.engine.base import EngineLoadSnapshot
    snapshot = EngineLoadSnapshot(running=8, waiting=0, waiting_uncached_tokens=0,
                                  used_blocks=4000, total_blocks=29205, block_size=16,
                                  max_running=256, gen_throughput=900.0, cache_hit_rate=0.1)
    return load_record(snapshot, 1, load_only=False, full=False)


def make_batches(count: int, requests_per_batch: int, rnd: random.Random,
                 blocks_per_request: int = 9, block_size: int = 16) -> list[bytes]:
    """Serialized KvEventBatch messages as kvswitch.engine.kv_events builds them."""
    out: list[bytes] = []
    live: deque[int] = deque()
    next_hash = 1
    event_id = 1
    for seq in range(count):
        events: list[common_pb2.KvCacheEvent] = []
        # Steady state: once 2,000 blocks are cached, evict as many as are stored.
        evictions = min(max(0, len(live) - 2000), requests_per_batch * blocks_per_request)
        evict = [live.popleft() for _ in range(evictions)]
        if evict:
            events.append(common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(
                block_hashes=[to_int64(h) for h in evict])))
        for _ in range(requests_per_batch):
            stored = common_pb2.KvBlocksStored()
            for _ in range(blocks_per_request):
                h = next_hash * 0x9E3779B97F4A7C15 & ((1 << 64) - 1)
                next_hash += 1
                stored.blocks.append(common_pb2.KvBlock(
                    block_hash=to_int64(h), block_size=block_size,
                    token_ids=[rnd.randrange(100, 100_000) for _ in range(block_size)]))
                live.append(h)
            events.append(common_pb2.KvCacheEvent(stored=stored))
        for offset, event in enumerate(events):
            event.event_id = event_id + offset
        event_id += len(events)
        out.append(common_pb2.KvEventBatch(sequence_number=seq, timestamp=time.time(),
                                           events=events, load=_load()).SerializeToString())
    return out


def kv_event_cost(requests_per_batch: int, batches: int, seed: int) -> dict[str, float]:
    rnd = random.Random(seed)
    wire = make_batches(batches, requests_per_batch, rnd)
    messages = [KvEventBatchView.FromString(w) for w in wire]  # as the subscriber reads them
    index = KvBlockIndex(16)
    index.add_endpoint("e")
    blocks = sum(len(e.stored.blocks) + len(e.removed.block_hashes)
                 for m in messages for e in m.events)
    convert = apply = 0.0
    for message in messages:
        c0 = time.process_time()
        batch = batch_from_proto(message)
        c1 = time.process_time()
        index.apply("e", batch.events)
        c2 = time.process_time()
        convert += c1 - c0
        apply += c2 - c1
    n = len(messages)
    return {"requests_per_batch": requests_per_batch, "batches": n,
            "block_events_per_batch": blocks / n,
            "batch_from_proto_us": convert / n * 1e6, "apply_us": apply / n * 1e6,
            "total_us_per_batch": (convert + apply) / n * 1e6,
            "total_us_per_block_event": (convert + apply) / blocks * 1e6}


async def engine_batches(seconds: float, rate: float, in_flight: int, seed: int
                         ) -> dict[str, float]:
    """KV-event batches per second one simulated engine publishes (what each EPP subscription
    decodes) under the gateway benchmark's per-engine load: `rate` req/s of 128-token prompts and
    16 output tokens at time scale 10000, at most `in_flight` at a time, each holding its slot
    20-60 ms (the rest of the gateway round trip)."""
    from kvswitch.engine.base import GenerationRequest, SamplingOptions
    from kvswitch.engine.sim import SimConfig, SimEngine

    engine = SimEngine(SimConfig(profile="llama3-8b-h100", time_scale=10_000.0, mode="random"))
    await engine.start()
    rnd = random.Random(seed)
    slots = asyncio.Semaphore(in_flight)
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        async with slots:
            prompt = [rnd.randrange(100, 100_000) for _ in range(128)]
            options = SamplingOptions(max_tokens=16, ignore_eos=True)
            async for _ in engine.generate(GenerationRequest(f"r{i}", prompt, options)):
                pass
            await asyncio.sleep(rnd.uniform(0.02, 0.06))
            done += 1

    log = engine._events
    first, start = log.next_sequence_number, time.monotonic()
    tasks: list[asyncio.Task[None]] = []
    while time.monotonic() - start < seconds:
        tasks.append(asyncio.create_task(one(len(tasks))))
        await asyncio.sleep(rnd.expovariate(rate))
    wall = time.monotonic() - start
    batches = log.next_sequence_number - first
    await asyncio.gather(*tasks)
    stored = sum(len(b.stored) for b in list(log.history)[-batches:])
    await engine.stop()
    return {"offered_req_per_s": rate, "in_flight": in_flight, "req_per_s": done / wall,
            "batches_per_s": batches / wall, "stored_blocks_per_batch": stored / max(batches, 1),
            "coalesce_seconds": log.coalesce_seconds}


def best_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the least CPU (other processes only ever add to it)."""
    key = "cpu_us_per_request" if "cpu_us_per_request" in rounds[0] else "total_us_per_batch"
    return min(rounds, key=lambda r: r[key])


async def run(args: argparse.Namespace) -> dict[str, object]:
    if args.only == "kv_events":  # for iterating on the event path alone
        return {"rounds": args.rounds, "kv_events": [
            best_of([kv_event_cost(r, args.batches, args.seed) for _ in range(args.rounds)])
            for r in (1, 6)]}
    routing = []
    for endpoints in (4, 16):
        for prompt_tokens in (128, 1024):
            routing.append(best_of([await routing_cost(endpoints, prompt_tokens, args.requests,
                                                       args.warmup, args.seed)
                                    for _ in range(args.rounds)]))
    routing.append(best_of([await routing_cost(4, 128, args.requests, args.warmup, args.seed,
                                               events=True) for _ in range(args.rounds)]))
    kv = [best_of([kv_event_cost(r, args.batches, args.seed) for _ in range(args.rounds)])
          for r in (1, 6)]
    result: dict[str, object] = {"rounds": args.rounds, "routing": routing, "kv_events": kv}
    if args.engine_seconds:
        result["engine_batches"] = await engine_batches(args.engine_seconds, 125.0, 8, args.seed)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="repeat each case; report the best")
    parser.add_argument("--engine-seconds", type=float, default=3.0,
                        help="how long to drive one simulated engine for engine_batches; 0: skip")
    parser.add_argument("--only", choices=["kv_events"], help="run only these cases")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/epp_routing_cpu.json"))
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
