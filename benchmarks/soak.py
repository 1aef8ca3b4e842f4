"""Soak: the whole gateway at about twice its pool's capacity for a long time, with mixed
tenants, cancellations, sheddable requests and bad requests mixed in.

Starts `--replicas` simulated engines, the EPP and Envoy (`kvswitch.launcher.launch_gateway`, as
`kvswitch up` does; the EPP config adds a sheddable `InferenceObjective` "batch" of priority -1)
and keeps `--concurrency` gRPC clients busy (default: 2 x replicas x the profile's max_num_seqs,
about twice what the pool runs at once). Each request, by a fixed cycle:
- most are streams of `--tokens` tokens for one of `--tenants` tenants (fairness ids, in turn);
- every 10th is cancelled after its first chunk;
- every 20th is a bad request (n past the limit, or a truncated gRPC frame): INVALID_ARGUMENT;
- every 20th names the sheddable objective: served, or shed (RESOURCE_EXHAUSTED) when the pool
  is saturated.
On top, every `--surge-every` seconds a surge: `--surge-clients` more clients send only sheddable
requests of `--surge-tokens` tokens for `--surge-seconds`, which saturates the pool, so the
EPP's shedding path runs.
After `--warmup` seconds the RSS of every process is taken; at the end again. Reported: RSS per
process at both points and its growth (goal: under 5 %), errors by kind and request class
(goal: only bad requests and shed sheddable ones fail), the share of surge requests shed, and
Jain's fairness index over the
tenants' streamed tokens, (sum x)^2 / (n * sum x^2) (goal: at least 0.95). Prints a summary and
saves JSON.

    .venv/bin/python benchmarks/soak.py                         # 30 minutes
    .venv/bin/python benchmarks/soak.py --duration 90 --warmup 20   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc

from kvswitch.launcher import DEFAULT_EPP_CONFIG, GatewaySpec, free_port, launch_gateway
from kvswitch.protocol import GENERATE_PATH, vllm_engine_pb2_grpc
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.supervisor import Supervisor

FAIRNESS = "x-llm-d-inference-fairness-id"
OBJECTIVE = "x-llm-d-inference-objective"
SHEDDABLE = {"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
             "kind": "InferenceObjective", "metadata": {"name": "batch"},
             "spec": {"priority": -1}}
MAX_NUM_SEQS = {"tiny": 4}


def rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def jain(values: list[float]) -> float:
    total, squares = sum(values), sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 1.0


class Load:
    """The clients: a shared counter picks each request's class, results are tallied."""

    def __init__(self, stub: vllm_engine_pb2_grpc.VllmEngineStub, address: str,
                 tenants: int, tokens: int, surge_tokens: int) -> None:
        self.stub, self.address = stub, address
        self.tenants, self.tokens, self.surge_tokens = tenants, tokens, surge_tokens
        self.counter = self.surge_counter = 0
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.tenant_tokens = [0] * tenants

    def next_class(self) -> tuple[str, int]:
        self.counter += 1
        n = self.counter
        if n % 20 == 0:
            return "bad", n
        if n % 20 == 10:
            return "sheddable", n
        if n % 10 == 5:
            return "cancelled", n
        return "stream", n

    async def worker(self, stop_at: float, surge: bool = False) -> None:
        while time.monotonic() < stop_at:
            if surge:  # a count of its own, so the other clients' cycle of classes stays whole
                self.surge_counter += 1
                kind, n = "surge", self.surge_counter
            else:
                kind, n = self.next_class()
            try:
                outcome = await self.one(kind, n)
            except grpc.aio.AioRpcError as exc:
                outcome = exc.code().name
            self.outcomes[(kind, outcome)] += 1

    async def one(self, kind: str, n: int) -> str:
        tenant = n % self.tenants
        metadata = [(FAIRNESS, f"tenant-{tenant}")]
        if kind in ("sheddable", "surge"):
            metadata.append((OBJECTIVE, "batch"))
        if kind == "bad":
            return await self.bad(n)
        request = pb.GenerateRequest(
            tokenized=pb.TokenizedInput(input_ids=[1000 + (n * 31 + i) % 30000
                                                   for i in range(64)]),
            stream=True, sampling_params=pb.SamplingParams(max_tokens=self.surge_tokens
                                                           if kind == "surge" else self.tokens,
                                                           ignore_eos=True))
        call = self.stub.Generate(request, metadata=metadata, timeout=120)
        async for message in call:
            if message.HasField("chunk"):
                if kind == "stream":
                    self.tenant_tokens[tenant] += len(message.chunk.token_ids)
                if kind == "cancelled":
                    call.cancel()
                    return "cancelled-by-client"
            if message.HasField("complete"):
                return "OK"
        return "ended without complete"

    async def bad(self, n: int) -> str:
        if n % 40 == 0:  # an absurd n
            request = pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(n=10**6))
            async for _ in self.stub.Generate(request, timeout=30):
                pass
            return "OK"
        # A truncated frame, by hand: a length prefix 10 bytes past the body.
        from tests.support.raw_grpc import call as raw_call

        message = pb.GenerateRequest(text="x").SerializeToString()
        body = b"\x00" + struct.pack(">I", len(message) + 10) + message
        status, _ = await raw_call(int(self.address.rsplit(":", 1)[1]), GENERATE_PATH, body,
                                   timeout=30)
        return grpc.StatusCode.INVALID_ARGUMENT.name if status == 3 else f"grpc-status {status}"


async def surges(load: Load, args: argparse.Namespace, started: float, stop_at: float) -> int:
    """Runs the surges of sheddable clients until `stop_at`; returns how many ran."""
    count = 0
    next_at = started + args.surge_every / 2
    while args.surge_clients and next_at + args.surge_seconds <= stop_at:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        end = next_at + args.surge_seconds
        await asyncio.gather(*(load.worker(end, surge=True) for _ in range(args.surge_clients)))
        count += 1
        next_at += args.surge_every
    return count


async def drive(address: str, args: argparse.Namespace, pids: dict[str, int]
                ) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        load = Load(vllm_engine_pb2_grpc.VllmEngineStub(channel), address, args.tenants,
                    args.tokens, args.surge_tokens)
        started = time.monotonic()
        stop_at = started + args.duration
        workers = [asyncio.create_task(load.worker(stop_at)) for _ in range(args.concurrency)]
        surge_task = asyncio.create_task(surges(load, args, started, stop_at))
        await asyncio.sleep(min(args.warmup, args.duration))
        rss_start = {name: rss_mib(pid) for name, pid in pids.items()}
        tokens_at_warmup = list(load.tenant_tokens)
        await asyncio.gather(*workers)
        surge_count = await surge_task
        rss_end = {name: rss_mib(pid) for name, pid in pids.items()}
    measured = [a - b for a, b in zip(load.tenant_tokens, tokens_at_warmup, strict=True)]
    growth = {name: (round(100 * (rss_end[name] - rss_start[name]) / rss_start[name], 2)
                     if rss_start[name] and rss_end[name] else None) for name in pids}
    unexpected = {f"{kind}:{outcome}": count for (kind, outcome), count in load.outcomes.items()
                  if not _expected(kind, outcome)}
    surge_total = sum(c for (kind, _), c in load.outcomes.items() if kind == "surge")
    surge_shed = load.outcomes[("surge", "RESOURCE_EXHAUSTED")]
    return {
        "duration_s": round(time.monotonic() - started, 1), "concurrency": args.concurrency,
        "surges": surge_count, "surge_requests": surge_total,
        "surge_shed_share": round(surge_shed / surge_total, 4) if surge_total else None,
        "requests": sum(load.outcomes.values()),
        "outcomes": {f"{kind}:{outcome}": count
                     for (kind, outcome), count in sorted(load.outcomes.items())},
        "unexpected_failures": unexpected,
        "rss_mib_after_warmup": rss_start, "rss_mib_end": rss_end, "rss_growth_pct": growth,
        "tenant_tokens_after_warmup": measured, "jain_fairness": round(jain(measured), 4),
        "goals": {"rss_growth_under_5pct": all(g is not None and g < 5 for g in growth.values()),
                  "only_expected_failures": not unexpected,
                  "jain_at_least_0.95": jain(measured) >= 0.95},
    }


def _expected(kind: str, outcome: str) -> bool:
    if outcome in ("OK", "cancelled-by-client"):
        return kind in ("stream", "cancelled", "sheddable", "surge")
    if kind == "bad":
        return outcome == "INVALID_ARGUMENT"
    return kind in ("sheddable", "surge") and outcome == "RESOURCE_EXHAUSTED"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=120.0,
                        help="seconds before the baseline RSS is taken")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--profile", default="tiny")
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="clients (default: 2 x replicas x the profile's max_num_seqs)")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per stream")
    parser.add_argument("--surge-every", type=float, default=60.0,
                        help="seconds from one surge of sheddable clients to the next")
    parser.add_argument("--surge-seconds", type=float, default=15.0, help="length of a surge")
    parser.add_argument("--surge-tokens", type=int, default=256,
                        help="tokens per surge request (long: batch work)")
    parser.add_argument("--surge-clients", type=int, default=None,
                        help="clients in a surge, sending only sheddable requests "
                             "(default: 2 x --concurrency; 0: no surges)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/soak.json")
    args = parser.parse_args()
    if args.concurrency is None:
        args.concurrency = 2 * args.replicas * MAX_NUM_SEQS.get(args.profile, 64)
    if args.surge_clients is None:
        args.surge_clients = 2 * args.concurrency
    state = Path(tempfile.mkdtemp(prefix="kvswitch-soak-"))
    with Supervisor(state) as supervisor:
        gateway = launch_gateway(supervisor, GatewaySpec(
            port=free_port(), replicas=args.replicas, profile=args.profile,
            time_scale=args.time_scale, mode="random", grace_period=1.0,
            epp_config=[DEFAULT_EPP_CONFIG, SHEDDABLE]), state)
        pids = {child.name: child.pid for child in supervisor.children}
        report = asyncio.run(drive(gateway.address, args, pids))
    report["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print(json.dumps({k: report[k] for k in ("duration_s", "requests", "outcomes", "surges",
                                             "surge_requests", "surge_shed_share",
                                             "unexpected_failures", "rss_growth_pct",
                                             "jain_fairness", "goals")}, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"saved {args.out} (logs in {state})")
    return 0 if all(report["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
