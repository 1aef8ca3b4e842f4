"""Scheduling latency and CPU per request of the EPP router, in process (no network).

16 endpoints with varied load, 1k-token tokenized prompts in shared-prefix groups (a system
prefix per group + a unique question), the default profile (prefix-cache 3, queue 2,
kv-cache-utilization 2, max-score-picker). Each request is routed then finished, as the
request path does. Then `text_prompts`: what tokenizing a *text* prompt in the EPP costs per
request (precise-prefix-cache-scorer with text input, the bundled Qwen3 tokenizer) for ~1k- and
~7k-token prompts, and the whole produce() step (tokenize + block hashes + index match) with it.
Prints and saves JSON.

    .venv/bin/python benchmarks/epp_scheduling.py --requests 20000 --out /tmp/epp_scheduling.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from kvswitch.epp.config import build_endpoint_picker, static_pool
from kvswitch.epp.contracts import InferenceRequest, ParsedBody, RequestOutcome
from kvswitch.epp.datalayer import Metrics
from kvswitch.epp.metrics import EppMetrics
from kvswitch.epp.router import EppRouter
from kvswitch.protocol.packed import PackedTokenIds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args: argparse.Namespace) -> dict[str, object]:
    rnd = random.Random(args.seed)
    # Loopback ports nothing listens on: routing is in process; a plugin that subscribes to
    # the endpoints (precise-prefix-cache-scorer) is refused at once and never gets events.
    addresses = [f"127.0.0.1:{1 + i}" for i in range(args.endpoints)]
    router = build_endpoint_picker(args.config, static_pool(addresses), metrics=EppMetrics()).router
    assert isinstance(router, EppRouter)
    datalayer = router.datalayer
    datalayer.set_endpoints(router.refresher.discovery.endpoints)  # type: ignore[union-attr]
    datalayer.staleness = 1e9
    for a in addresses:
        datalayer.update(a, Metrics(running=rnd.randrange(20), waiting=rnd.randrange(4),
                                    kv_usage=rnd.random() * 0.7, max_tokens=29205 * 16,
                                    block_size=16, updated_at=datalayer.clock()))
    prefixes = [tuple(rnd.randrange(150_000) for _ in range(args.prefix_tokens))
                for _ in range(args.groups)]
    suffix = args.prompt_tokens - args.prefix_tokens
    suffixes = [tuple(rnd.randrange(150_000) for _ in range(suffix)) for _ in range(256)]
    latencies: list[float] = []
    cpu = 0.0
    wall_start = time.perf_counter()
    for i in range(args.requests + args.warmup):
        # Built outside the timed section; only route + request_finished are measured.
        tokens = rnd.choice(prefixes) + suffixes[i % len(suffixes)][:-1] + (i,)
        # Packed, as the vllmgrpc parser hands a tokenized prompt over.
        request = InferenceRequest(f"r{i}", "grpc", "/vllm.grpc.engine.VllmEngine/Generate",
                                   ParsedBody(prompt_token_ids=PackedTokenIds.of(tokens)))
        if i == args.warmup:
            wall_start = time.perf_counter()
        c0, t0 = time.process_time(), time.perf_counter()
        decision = await router.route(request, None)
        router.request_finished(request, RequestOutcome(decision.endpoints[0], ok=True,
                                                        prompt_tokens=args.prompt_tokens))
        t1, c1 = time.perf_counter(), time.process_time()
        if i >= args.warmup:
            latencies.append(t1 - t0)
            cpu += c1 - c0
    wall = time.perf_counter() - wall_start
    return {
        "endpoints": args.endpoints, "requests": args.requests,
        "prompt_tokens": args.prompt_tokens, "prefix_tokens": args.prefix_tokens,
        "groups": args.groups, "config": str(args.config or "defaults"),
        "route_latency_ms": {"p50": percentile(latencies, 0.5) * 1e3,
                             "p90": percentile(latencies, 0.9) * 1e3,
                             "p99": percentile(latencies, 0.99) * 1e3,
                             "mean": statistics.fmean(latencies) * 1e3},
        "cpu_ms_per_request": cpu / args.requests * 1e3,
        "wall_s": wall,
    }


_WORDS = ["the", "model", "serves", "requests", "from", "many", "tenants", "while", "the",
          "gateway", "routes", "each", "prompt", "to", "a", "replica", "that", "already", "holds",
          "its", "prefix", "in", "the", "key", "value", "cache", "so", "prefill", "work", "is",
          "saved", "and", "latency", "drops", "under", "load", "for", "long", "system", "prompts",
          "shared", "by", "users"]


def text_of(tokenizer, tokens: int, rnd: random.Random) -> str:  # type: ignore[no-untyped-def]
    """Real-looking English text of about `tokens` tokens (trimmed by re-encoding)."""
    words = [rnd.choice(_WORDS) for _ in range(tokens * 2)]
    ids = tokenizer.encode(" ".join(words))[:tokens]
    return str(tokenizer.decode(ids))


def text_prompt_cost(sizes: list[int], rounds: int, seed: int) -> dict[str, object]:
    """CPU per request of tokenizing text prompts in the EPP, and of the scorer's produce()."""
    from kvswitch.epp.datalayer import Datalayer, Endpoint, EndpointSpec
    from kvswitch.epp.framework import PluginHandle
    from kvswitch.epp.plugins.precise_prefix_cache_scorer import create

    rnd = random.Random(seed)
    scorer = create("p", {"blockSize": 16}, PluginHandle(Datalayer()))
    tokenizer = scorer.tokenizer
    assert tokenizer is not None
    endpoints = [Endpoint(EndpointSpec(f"10.0.0.{i}:8000")) for i in range(16)]
    out: dict[str, object] = {"tokenizer": "bundled Qwen3 (tokenizers, Rust)", "endpoints": 16}
    for size in sizes:
        texts = [text_of(tokenizer, size, rnd) for _ in range(8)]
        real = statistics.fmean(len(tokenizer.encode(t)) for t in texts)
        scorer.index.apply(endpoints[0].address, [])  # an index with a known endpoint
        encode_cpu = produce_cpu = 0.0
        n = max(rounds * 1024 // size, 10)
        for i in range(n):
            text = texts[i % len(texts)]
            c0 = time.process_time()
            tokenizer.encode(text)
            c1 = time.process_time()
            request = InferenceRequest(f"t{i}", "grpc", "/g", ParsedBody(prompt_text=text))
            c2 = time.process_time()
            scorer.produce(request, {}, endpoints)
            c3 = time.process_time()
            encode_cpu += c1 - c0
            produce_cpu += c3 - c2
        out[f"{size}_tokens"] = {
            "prompt_tokens_mean": real, "prompt_chars_mean": statistics.fmean(map(len, texts)),
            "samples": n,
            "tokenize_cpu_ms_per_request": encode_cpu / n * 1e3,
            "produce_with_text_cpu_ms_per_request": produce_cpu / n * 1e3,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--prefix-tokens", type=int, default=768)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=Path, default=None, help="EndpointPickerConfig YAML")
    parser.add_argument("--text-rounds", type=int, default=200,
                        help="1k-token text prompts to tokenize (fewer for longer ones); 0: skip")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/epp_scheduling.json"))
    args = parser.parse_args()
    result = asyncio.run(run(args))
    if args.text_rounds:
        result["text_prompts"] = text_prompt_cost([1024, 7200], args.text_rounds, args.seed)
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
