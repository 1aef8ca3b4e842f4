"""The load generator's request: one `Generate` over gRPC, timed on the client side.

Streamed (`stream=True`): a message per engine read; the client measures TTFT, ITL and e2e.
Non-streamed: one response message per request, so the client, Envoy and the EPP do a fixed
amount of work per request instead of per token; the client measures only e2e, and TTFT comes
from the engines' request logs (`kvswitch.bench.report`).

Times are measured on the wall clock and reported in *simulated* seconds (wall x time scale),
so they compare with the engine's simulated step times and with published GPU numbers; routing
overheads (Envoy, EPP, client) are scaled the same way, which overstates them by the time scale.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvswitch.bench.workloads import BenchRequest
from kvswitch.protocol import vllm_engine_pb2, vllm_engine_pb2_grpc
from kvswitch.protocol.sglang import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

_MAX_MESSAGE = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RequestResult:
    index: int
    stage: int
    qps: float
    ok: bool
    error: str = ""
    ttft: float | None = None
    """Simulated seconds from send to the first output token (None when not streamed)."""
    e2e: float | None = None
    itl: float | None = None
    """Mean simulated seconds between output tokens after the first."""
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    endpoint: str = ""
    """The engine that served it, when the target knows (oracle); else empty."""
    sent_at: float = 0.0
    """Simulated seconds from the start of the run to the send (set by the runner)."""
    tail: float | None = None
    """Simulated seconds from the last response message to the end of the call (the trailers;
    through kvswitch this includes the EPP's reply to the response-trailers message)."""


class Channels:
    """A few channels per address (HTTP/2 connections), used in turn; stubs of `api`."""

    def __init__(self, per_address: int = 4, api: str = "vllm") -> None:
        self.per_address = per_address
        self.api = api
        self._stub_class: Any = (sglang_scheduler_pb2_grpc.SglangSchedulerStub
                                 if api == "sglang" else vllm_engine_pb2_grpc.VllmEngineStub)
        self._stubs: dict[str, itertools.cycle[vllm_engine_pb2_grpc.VllmEngineStub]] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, address: str) -> vllm_engine_pb2_grpc.VllmEngineStub:
        stubs = self._stubs.get(address)
        if stubs is None:
            made = []
            for i in range(self.per_address):
                channel = grpc.aio.insecure_channel(address, options=[
                    ("grpc.max_receive_message_length", _MAX_MESSAGE),
                    ("grpc.max_send_message_length", _MAX_MESSAGE),
                    ("grpc.channel_id", i)])  # distinct options: distinct connections
                self._channels.append(channel)
                made.append(self._stub_class(channel))
            stubs = self._stubs[address] = itertools.cycle(made)
        return next(stubs)

    async def connect(self, addresses: list[str], timeout: float = 10.0) -> None:
        """Open every connection before the clock starts (no handshakes inside TTFTs)."""
        for address in addresses:
            self.stub(address)
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in self._channels)),
                               timeout)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))
        self._channels.clear()
        self._stubs.clear()


def generate_request(request: BenchRequest, run_id: str, text: str | None = None,
                     stream: bool = True, api: str = "vllm", answer: str | None = None) -> Any:
    """The request in the pool's API (SGLang's: token ids, or text as `original_text`). An
    `answer` (a multi-turn request's, `workloads.answer_text`) is asked for as structured output:
    a one-option choice in vLLM's API, a regex matching only it in SGLang's."""
    if api == "sglang":
        s = sglang_scheduler_pb2
        return s.GenerateRequest(
            request_id=f"{run_id}-{request.index}", stream=stream,
            tokenized=s.TokenizedInput(original_text=text) if text is not None
            else s.TokenizedInput(input_ids=request.prompt_ids),
            sampling_params=s.SamplingParams(max_new_tokens=request.max_tokens, ignore_eos=True,
                                             temperature=0.0, top_p=1.0, top_k=-1,
                                             repetition_penalty=1.0,
                                             regex=re.escape(answer) if answer else None))
    sampling = vllm_engine_pb2.SamplingParams(max_tokens=request.max_tokens, ignore_eos=True,
                                              temperature=0.0)
    if answer:
        sampling.choice.choices.append(answer)
    common = {"request_id": f"{run_id}-{request.index}", "sampling_params": sampling,
              "stream": stream}
    if text is not None:
        return vllm_engine_pb2.GenerateRequest(text=text, **common)
    return vllm_engine_pb2.GenerateRequest(
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=request.prompt_ids), **common)


async def send(stub: Any, message: Any,
               request: BenchRequest, time_scale: float, timeout: float,
               endpoint: str = "", on_first: Callable[[], None] | None = None) -> RequestResult:
    """Run one request to the end; never raises (failures are results). Either API's messages:
    their chunk and complete fields are named alike."""
    started = time.perf_counter()
    first: float | None = None
    last = started
    tokens = prompt = cached = 0
    base: dict[str, Any] = {"index": request.index, "stage": request.stage,
                            "qps": request.qps, "endpoint": endpoint}
    try:
        async for response in stub.Generate(message, timeout=timeout):
            kind = response.WhichOneof("response")
            part = response.chunk if kind == "chunk" else response.complete
            if kind == "chunk":
                tokens += len(part.token_ids)
            elif not tokens:
                tokens = len(part.output_ids)
            if first is None and tokens:
                first = time.perf_counter()
                if on_first is not None:
                    on_first()
            prompt, cached = part.prompt_tokens or prompt, part.cached_tokens or cached
            last = time.perf_counter()
    except grpc.aio.AioRpcError as exc:
        return RequestResult(ok=False, error=f"{exc.code().name}: {exc.details()}", **base)
    end = time.perf_counter()
    if first is None:
        return RequestResult(ok=False, error="no output", **base)
    e2e = (end - started) * time_scale
    if not message.stream:  # one message at the end: no client-side TTFT or ITL
        return RequestResult(ok=True, e2e=e2e, output_tokens=tokens, prompt_tokens=prompt,
                             cached_tokens=cached, tail=(end - last) * time_scale, **base)
    ttft = (first - started) * time_scale
    itl = (e2e - ttft) / (tokens - 1) if tokens > 1 else None
    return RequestResult(ok=True, ttft=ttft, e2e=e2e, itl=itl, output_tokens=tokens,
                         prompt_tokens=prompt, cached_tokens=cached,
                         tail=(end - last) * time_scale, **base)
