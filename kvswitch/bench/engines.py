"""The benchmark's engine pool: start simulated engines, flush them cold, read their counters.

Engines are started once per run through `kvswitch.supervisor` (the same specs `kvswitch up`
uses), each with a Prometheus port. Between targets every engine's prefix cache is flushed
(`FlushCache`, after waiting for it to go idle), so each target starts cold. Counters come from
`/metrics` (vLLM names): `vllm:prefix_cache_{queries,hits}_total` (tokens),
`vllm:request_success_total`, `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`;
a target's numbers are the deltas over its run.

Each engine also writes a request log (`kvswitch engine --request-log`, one JSON line per ended
request, timed on the engine's clock); `new_records()` returns what the engines logged since the
previous call, so every target (gateways, SMG, the oracle) is measured the same way, by the
engines themselves.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvswitch.engine.request_log import RequestRecord, read_records
from kvswitch.launcher import engine_spec, free_port
from kvswitch.protocol import common_pb2, vllm_engine_pb2_grpc
from kvswitch.protocol.sglang import sglang_scheduler_pb2_grpc
from kvswitch.supervisor import Supervisor

COUNTERS = {
    "vllm:prefix_cache_queries_total": "cache_queries",
    "vllm:prefix_cache_hits_total": "cache_hits",
    "vllm:request_success_total": "requests",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:num_preemptions_total": "preemptions",
    # The engine's own latency histograms, in its clock (simulated seconds for the simulator):
    # their mean over a run, next to the client's wall-clock x time-scale mean, shows whether
    # the processes kept up with the simulated clock.
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
    "vllm:e2e_request_latency_seconds_sum": "e2e_sum",
    "vllm:e2e_request_latency_seconds_count": "e2e_count",
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
}


@dataclass(frozen=True, slots=True)
class EngineCounters:
    cache_queries: float = 0.0
    cache_hits: float = 0.0
    requests: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    preemptions: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    e2e_sum: float = 0.0
    e2e_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0

    def minus(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(*(getattr(self, f) - getattr(other, f) for f in COUNTERS.values()))


def parse_counters(text: str) -> EngineCounters:
    """Sum each counter of interest over its label sets (finish reasons, models)."""
    totals = dict.fromkeys(COUNTERS.values(), 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        field = COUNTERS.get(name)
        if field is not None:
            totals[field] += float(line.rsplit(" ", 1)[1])
    return EngineCounters(**totals)


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    address: str
    """`127.0.0.1:port` of the gRPC API."""
    metrics_url: str
    request_log: Path | None = None
    """Its `--request-log` file, when the pool keeps one."""


class EnginePool:
    """`replicas` simulated engines under `supervisor`, serving `api` ("vllm" or "sglang")."""

    def __init__(self, supervisor: Supervisor, replicas: int, profile: str, time_scale: float,
                 mode: str = "random", extra_args: tuple[str, ...] = (),
                 request_log_dir: Path | None = None, api: str = "vllm") -> None:
        self.supervisor = supervisor
        self.api = api
        self.profile = profile
        self.time_scale = time_scale
        self.engines: list[Engine] = []
        specs = []
        for i in range(replicas):
            port, http_port = free_port(), free_port()
            name = f"engine-{i}"
            log = request_log_dir / f"{name}.requests.jsonl" if request_log_dir else None
            log_args = ("--request-log", str(log)) if log else ()
            specs.append(engine_spec(name, port, profile=profile, time_scale=time_scale,
                                     mode=mode, grace_period=1.0,
                                     extra=("--http-port", str(http_port), "--log-level",
                                            "WARNING", "--api", api, *log_args,
                                            *extra_args)))
            self.engines.append(Engine(name, f"127.0.0.1:{port}",
                                       f"http://127.0.0.1:{http_port}/metrics", log))
        self._specs = specs
        self._offsets: dict[str, int] = {}

    def start(self) -> None:
        self.supervisor.start_all(self._specs, timeout=120.0)

    @property
    def addresses(self) -> list[str]:
        return [e.address for e in self.engines]

    async def counters(self) -> dict[str, EngineCounters]:
        def read(url: str) -> EngineCounters:
            with urllib.request.urlopen(url, timeout=5.0) as response:
                return parse_counters(response.read().decode())

        results = await asyncio.gather(*(asyncio.to_thread(read, e.metrics_url)
                                         for e in self.engines))
        return {e.address: c for e, c in zip(self.engines, results, strict=True)}

    def new_records(self) -> dict[str, list[RequestRecord]]:
        """Per engine address: the request records logged since the previous call."""
        out: dict[str, list[RequestRecord]] = {}
        for e in self.engines:
            if e.request_log is None or not e.request_log.exists():
                out[e.address] = []
                continue
            records, self._offsets[e.address] = read_records(
                e.request_log, self._offsets.get(e.address, 0))
            out[e.address] = records
        return out

    async def records_since(self, wall: float, want: int, timeout: float = 5.0
                            ) -> dict[str, list[RequestRecord]]:
        """Records of requests that arrived at or after wall time `wall`, waiting up to
        `timeout` s (the engines write their logs every second) until there are `want`."""
        got: dict[str, list[RequestRecord]] = {e.address: [] for e in self.engines}
        deadline = time.monotonic() + timeout
        while True:
            for address, records in self.new_records().items():
                got[address] += [r for r in records if r.arrival_wall >= wall]
            if sum(map(len, got.values())) >= want or time.monotonic() >= deadline:
                return got
            await asyncio.sleep(0.25)

    async def flush(self, timeout: float = 60.0) -> dict[str, bool]:
        """FlushCache on every engine (each waits up to `timeout` s to go idle first)."""
        async def one(address: str) -> bool:
            async with grpc.aio.insecure_channel(address) as channel:
                stub: Any = (sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
                             if self.api == "sglang"
                             else vllm_engine_pb2_grpc.VllmEngineStub(channel))
                reply = await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=timeout),
                                              timeout=timeout + 10)
                return bool(reply.success)

        flushed = await asyncio.gather(*(one(a) for a in self.addresses))
        return dict(zip(self.addresses, flushed, strict=True))


def deltas(after: Mapping[str, EngineCounters],
           before: Mapping[str, EngineCounters]) -> dict[str, EngineCounters]:
    return {a: after[a].minus(before[a]) for a in after}
