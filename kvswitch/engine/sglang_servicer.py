"""`sglang.grpc.scheduler.SglangScheduler` over an `Engine` backend, with SGLang's semantics.

The SGLang twin of `kvswitch.engine.servicer` (the same `servicer_base`: engine, pacing, metrics
and request log); request and response shapes live in `sglang_conversion`. Where SGLang's gRPC
server differs from vLLM's, this one answers as SGLang's does:
- errors are gRPC statuses: a request SGLang refuses is INVALID_ARGUMENT with its wording; a
  request aborted by the Abort RPC ends INTERNAL "Request aborted" (SGLang's request manager
  turns the scheduler's abort notice into that error); an abort the engine decides itself
  ends the sequence with finish_reason "abort".
- Abort takes one request id and answers success for any id (SGLang forwards it to the
  scheduler without looking it up).
- GetLoads reads `include` (core, memory, spec, lora, disagg, queues, all; default all; any
  other section is INVALID_ARGUMENT) and adds the aggregate; a dp_rank other than 0 gets none.
- SubscribeKvEvents publishes the radix cache's pages (`sglang_kv_events`), as SGLang started
  with `--kv-events-config '{"publisher": "zmq"}'`, each batch carrying an `EngineLoad`; with
  kvswitch's load push, and its queued prompts to a caller that asks, as the vLLM API's.
- LoRA is off, as in SGLang without `--enable-lora`: loads and unloads fail with its message,
  the list is empty, a request naming an adapter is INVALID_ARGUMENT; so are hidden states,
  multimodal inputs and input embeddings. `stream_interval` is not honoured (one chunk per
  engine read).
Deviations, on purpose: HealthCheck answers at once (SGLang runs a one-token request and polls
each second); n>1 unary completes carry their index; `tokenized.original_text` alone (no
input_ids) is tokenized here; Generate and Embed end with the `x-kvswitch-usage` trailer.
"""

from __future__ import annotations

import datetime
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp

from kvswitch import __version__
from kvswitch.engine.base import Engine, GenerationRequest
from kvswitch.engine.conversion import max_prompt_len
from kvswitch.engine.metrics import EngineMetrics
from kvswitch.engine.request_log import RequestLog
from kvswitch.engine.servicer_base import ServicerBase, scheduler_load_fields
from kvswitch.engine.sglang_conversion import (
    SglangResponseBuilder,
    prompt_from_sglang,
    sampling_from_sglang,
)
from kvswitch.engine.sglang_kv_events import check_page_size, split_pages
from kvswitch.errors import InvalidRequest, KvswitchError
from kvswitch.protocol import common_pb2
from kvswitch.protocol.sglang import sglang_scheduler_pb2 as pb
from kvswitch.protocol.sglang import sglang_scheduler_pb2_grpc
from kvswitch.tokenization import TokenizerBundle

logger = logging.getLogger(__name__)

LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to True."
SERVER_TYPE = "grpc"


class SglangSchedulerServicer(ServicerBase, sglang_scheduler_pb2_grpc.SglangSchedulerServicer):
    def __init__(self, engine: Engine, tokenizer: TokenizerBundle, *, page_size: int = 1,
                 tokenizer_dir: str | None = None, metrics: EngineMetrics | None = None,
                 request_log: RequestLog | None = None):
        check_page_size(page_size, engine.model.block_size)
        super().__init__(engine, tokenizer, tokenizer_dir=tokenizer_dir, metrics=metrics,
                         request_log=request_log)
        self.page_size = page_size
        self._aborted: set[str] = set()
        """Requests the Abort RPC ended: their Generate ends as SGLang's does (an error)."""

    # ---- Generate / Embed ---------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        self.last_receive_timestamp = received = time.time()
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        logger.info("Receive generation request: %s (stream=%s)", request_id, request.stream)
        try:
            prompt = prompt_from_sglang(request, self.card, self.tokenizer.encode)
            check_features_off(request)
            sampling, prefill_only = sampling_from_sglang(request, self.card, len(prompt))
            updates = self.engine.generate(GenerationRequest(
                request_id, prompt, sampling, received, incremental=request.stream))
        except KvswitchError as exc:
            await context.abort(exc.grpc_code, exc.message)
        builder = SglangResponseBuilder(
            request_id, prompt, sampling, request.stream, eos_token_ids=self.card.eos_token_ids,
            prefill_only=prefill_only, logprob_start_len=request.logprob_start_len)
        try:
            async with aclosing(self._stream_generate(
                    context, request_id, received, request.stream, updates, builder,
                    aborted=self._aborted)) as messages:
                async for message in messages:
                    yield message
        finally:
            self._aborted.discard(request_id)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
                    ) -> pb.EmbedResponse:
        request_id = request.request_id or f"grpc-embed-{uuid.uuid4().hex}"
        logger.info("Receive embedding request: %s", request_id)
        token_ids, embedding = await self._embed(
            context, request_id, lambda: prompt_from_sglang(request, self.card,
                                                            self.tokenizer.encode))
        return pb.EmbedResponse(embedding=embedding, prompt_tokens=len(token_ids),
                                embedding_dim=len(embedding))

    # ---- management ---------------------------------------------------------------------

    async def HealthCheck(self, request: pb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        if self.draining.is_set():
            return pb.HealthCheckResponse(healthy=False, message="Server is shutting down")
        if not self.engine.is_healthy():
            return pb.HealthCheckResponse(healthy=False, message="Scheduler is not responding")
        return pb.HealthCheckResponse(healthy=True, message="Health check passed")

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> pb.AbortResponse:
        rid = request.request_id
        logger.info("Receive abort request: %s", rid)
        if rid.startswith("HEALTH_CHECK"):
            return pb.AbortResponse(success=False, message=f"Request {rid} not found")
        if self.engine.has_request(rid):
            self._aborted.add(rid)
            await self.engine.abort([rid])
        return pb.AbortResponse(success=True, message=f"Request {rid} aborted")

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        card = self.card
        return pb.GetModelInfoResponse(
            model_path=card.model_path,
            tokenizer_path=card.tokenizer_path or self.tokenizer.source,
            is_generation=card.is_generation,
            weight_version="default",
            served_model_name=card.served_model_name,
            max_context_length=card.max_model_len,
            vocab_size=card.vocab_size,
            supports_vision=False,
            model_type=card.model_type,
            eos_token_ids=list(card.eos_token_ids),
            pad_token_id=card.pad_token_id,
            bos_token_id=card.bos_token_id,
            max_req_input_len=max_prompt_len(card),
            architectures=list(card.architectures),
        )

    def server_args(self) -> dict[str, object]:
        """The ServerArgs fields a client reads (SGLang sends all of them)."""
        card = self.card
        return {
            "model_path": card.model_path, "served_model_name": card.served_model_name,
            "tokenizer_path": card.tokenizer_path or self.tokenizer.source,
            "context_length": card.max_model_len, "page_size": self.page_size,
            "max_running_requests": card.max_num_seqs,
            "max_total_tokens": card.num_gpu_blocks * card.block_size,
            "chunked_prefill_size": card.max_num_batched_tokens, "dp_size": 1, "tp_size": 1,
            "is_embedding": not card.is_generation, "enable_lora": False,
            "kv_events_config": '{"publisher": "zmq"}', "disaggregation_mode": "null",
        }

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        card = self.card
        server_args, scheduler_info = Struct(), Struct()
        server_args.update(self.server_args())
        total = card.num_gpu_blocks * card.block_size
        scheduler_info.update({"max_total_num_tokens": total, "max_req_input_len":
                               max_prompt_len(card), "is_generation": card.is_generation})
        start = Timestamp()
        start.FromSeconds(int(self.start_time))
        return pb.GetServerInfoResponse(
            server_args=server_args, scheduler_info=scheduler_info,
            active_requests=self.active_requests, is_paused=False,
            last_receive_timestamp=self.last_receive_timestamp,
            uptime_seconds=time.time() - self.start_time, sglang_version=f"kvswitch-{__version__}",
            server_type=SERVER_TYPE, start_time=start, max_total_num_tokens=total)

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GetLoadsResponse:
        include = set(request.include) or {"all"}
        unknown = sorted(include - LOAD_SECTIONS)
        if unknown:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"Invalid include sections: {unknown}; valid sections: "
                                f"{sorted(LOAD_SECTIONS)}")
        loads = []
        if not request.HasField("dp_rank") or request.dp_rank == 0:
            loads.append(sglang_load(self.engine, include))
        response = pb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.UTC).isoformat(),
            version=f"kvswitch-{__version__}", dp_rank_count=len(loads), loads=loads)
        if loads:
            load = loads[0]
            response.aggregate.CopyFrom(pb.AggregateMetrics(
                total_running_reqs=load.num_running_reqs,
                total_waiting_reqs=load.num_waiting_reqs, total_reqs=load.num_total_reqs,
                avg_token_usage=round(load.token_usage, 4),
                avg_throughput=round(load.gen_throughput, 2),
                avg_utilization=round(load.utilization, 4)))
        return response

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext
                                ) -> AsyncIterator[common_pb2.KvEventBatch]:
        stream = self._kv_event_stream(request, context)
        await context.send_initial_metadata(())
        async for batch in stream.run(self.draining):
            split_pages(batch, self.page_size, self.card.block_size)
            yield batch

    async def FlushCache(self, request: common_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        flushed = await self._flush_when_idle(request.timeout_s)
        message = ("Cache flushed." if flushed else
                   "Cache not flushed: there are running or waiting requests.")
        return common_pb2.FlushCacheResponse(success=flushed, message=message)

    async def StartProfile(self, request: common_pb2.StartProfileRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        return common_pb2.ProfileResponse(
            success=True, message="Start profiling (simulated engine: nothing to profile).")

    async def StopProfile(self, request: common_pb2.StopProfileRequest,
                          context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        return common_pb2.ProfileResponse(
            success=True, message="Stop profiling (simulated engine: no traces written).")

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext) -> pb.LoadLoRAAdapterResponse:
        return pb.LoadLoRAAdapterResponse(success=False, message=LORA_DISABLED)

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext
                                ) -> pb.UnloadLoRAAdapterResponse:
        return pb.UnloadLoRAAdapterResponse(success=False, message=LORA_DISABLED)

    async def ListLoadedLoRAAdapters(self, request: pb.ListLoadedLoRAAdaptersRequest,
                                     context: grpc.aio.ServicerContext
                                     ) -> pb.ListLoadedLoRAAdaptersResponse:
        return pb.ListLoadedLoRAAdaptersResponse()


def check_features_off(request: pb.GenerateRequest) -> None:
    """What the simulator cannot do, refused as SGLang refuses it with the feature off."""
    if request.lora_id:
        raise InvalidRequest(LORA_DISABLED, param="lora_id")
    if request.return_hidden_states:
        raise InvalidRequest("return_hidden_states=True requires the server to be started with "
                             "--enable-return-hidden-states.", param="return_hidden_states")
    if request.HasField("mm_inputs"):
        raise InvalidRequest("This model does not support multimodal inputs (mm_inputs).",
                             param="mm_inputs")
    if request.input_embeds:
        raise InvalidRequest("input_embeds is not supported by this server.",
                             param="input_embeds")


def sglang_load(engine: Engine, include: set[str]) -> pb.SchedulerLoad:
    """SGLang's SchedulerLoad for the one DP rank; optional sections as `include` asks."""
    load = engine.load()
    out = pb.SchedulerLoad(**scheduler_load_fields(load))
    every = "all" in include
    if every or "memory" in include:
        out.memory.CopyFrom(pb.MemoryMetrics(token_capacity=load.total_tokens))
    if every or "queues" in include:
        out.queues.CopyFrom(pb.QueueMetrics(waiting=load.waiting))
    if every or "disagg" in include:
        out.disaggregation.CopyFrom(pb.DisaggregationMetrics(mode="null"))
    return out
