"""`vllm.grpc.engine.VllmEngine` over an `Engine` backend, with vLLM's servicer semantics.

Thin by design: protobuf <-> contract conversion and validation live in `conversion`, the
tokenizer archive in `tokenizer_bundle`, the scheduler in the backend. Deviations from vLLM's
servicer, each on purpose:
- Abort with unknown request ids succeeds and ignores them, as vLLM's `AsyncLLM.abort` does.
- Generate and Embed end with trailing metadata `x-kvswitch-usage` (the EPP reads usage there).
- GetServerInfo.last_receive_timestamp is the time the last Generate/Embed arrived (vLLM
  reports the current time, marked TODO upstream).
- A request that does not parse ends INVALID_ARGUMENT, not grpcio's UNKNOWN (the handlers
  parse it: `registration`).

Serving state, the Generate loop (pacing, metrics, request log) and the management RPCs
both engine APIs serve alike live in `servicer_base`.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from kvswitch import __version__
from kvswitch.engine import conversion
from kvswitch.engine.base import Engine, GenerationRequest
from kvswitch.engine.metrics import EngineMetrics
from kvswitch.engine.request_log import RequestLog
from kvswitch.engine.servicer_base import ServicerBase, scheduler_load_fields
from kvswitch.errors import InvalidRequest, KvswitchError
from kvswitch.limits import SAMPLING_DEFAULTS, SamplingLimits
from kvswitch.protocol import common_pb2, vllm_engine_pb2_grpc
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.tokenization import TokenizerBundle

logger = logging.getLogger(__name__)

_TOKENIZE_INLINE_CHARS = 16384  # longer text prompts are tokenized in a worker thread


class VllmEngineServicer(ServicerBase, vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, engine: Engine, tokenizer: TokenizerBundle, *,
                 tokenizer_dir: str | None = None, metrics: EngineMetrics | None = None,
                 request_log: RequestLog | None = None,
                 limits: SamplingLimits = SAMPLING_DEFAULTS):
        super().__init__(engine, tokenizer, tokenizer_dir=tokenizer_dir, metrics=metrics,
                         request_log=request_log)
        self.limits = limits

    # ---- Generate / Embed ---------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        self.last_receive_timestamp = received = time.time()
        request_id = request.request_id or uuid.uuid4().hex
        logger.info("Generate request %s: input_type=%s, stream=%s", request_id,
                    request.WhichOneof("input"), request.stream)
        try:
            prompt, sampling = self._prepare_generate(request, await self._tokenize(request))
        except KvswitchError as exc:
            await context.abort(exc.grpc_code, exc.message)
        builder = conversion.ResponseBuilder(prompt, sampling, request.stream)
        try:  # the backend checks the request against its model (max_model_len) here
            updates = self.engine.generate(GenerationRequest(
                request_id, prompt, sampling, received, incremental=request.stream))
        except KvswitchError as exc:
            await context.abort(exc.grpc_code, exc.message)
        async with aclosing(self._stream_generate(context, request_id, received, request.stream,
                                                  updates, builder)) as messages:
            async for message in messages:
                yield message

    async def _tokenize(self, request: pb.GenerateRequest) -> list[int] | None:
        """A text prompt's ids (None for tokenized input). vLLM's text path tokenizes with the
        model's special tokens (none for Qwen3); a long text in a worker thread, so a
        multi-megabyte prompt does not stall every stream on the event loop."""
        if request.WhichOneof("input") != "text":
            return None
        text = request.text
        if len(text) < _TOKENIZE_INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=True)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=True)

    def _prepare_generate(self, request: pb.GenerateRequest, text_ids: list[int] | None
                          ) -> tuple[list[int], conversion.SamplingOptions]:
        conversion.check_kv_transfer(request)
        kind = request.WhichOneof("input")
        if kind == "tokenized":
            prompt = list(request.tokenized.input_ids)
        elif kind == "text" and text_ids is not None:
            prompt = text_ids
        else:
            raise InvalidRequest("Generate needs an input: text or tokenized.", param="input")
        if request.HasField("mm_inputs") or request.HasField("media_refs"):
            raise InvalidRequest("This model does not support multimodal inputs (mm_inputs).",
                                 param="mm_inputs")
        prompt = conversion.truncate_prompt(prompt, request.sampling_params, self.card)
        conversion.check_prompt(prompt, self.card)
        return prompt, conversion.sampling_from_proto(request.sampling_params, self.card,
                                                      self.limits)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
                    ) -> pb.EmbedResponse:
        request_id = request.request_id or uuid.uuid4().hex
        logger.info("Embed request %s: input_type=tokenized", request_id)

        def prompt() -> list[int]:
            if not request.HasField("tokenized"):
                raise InvalidRequest("Embed requires tokenized input (tokenized.input_ids).",
                                     param="tokenized")
            token_ids = list(request.tokenized.input_ids)
            conversion.check_prompt(token_ids, self.card)
            return token_ids

        token_ids, embedding = await self._embed(context, request_id, prompt)
        return pb.EmbedResponse(embedding=embedding, prompt_tokens=len(token_ids),
                                embedding_dim=len(embedding))

    # ---- management ---------------------------------------------------------------------

    async def HealthCheck(self, request: pb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        if not self.engine.is_healthy():
            return pb.HealthCheckResponse(healthy=False, message="Engine is not alive")
        if self.draining.is_set():
            return pb.HealthCheckResponse(healthy=False, message="Server is shutting down")
        return pb.HealthCheckResponse(healthy=True, message="Health")

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> pb.AbortResponse:
        logger.info("Abort requests: %s", list(request.request_ids))
        await self.engine.abort(list(request.request_ids))
        return pb.AbortResponse()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        card = self.card
        return pb.GetModelInfoResponse(
            model_path=card.model_path,
            is_generation=card.is_generation,
            max_context_length=card.max_model_len,
            vocab_size=card.vocab_size,
            supports_vision=False,
            served_model_name=card.served_model_name,
            tokenizer_path=card.tokenizer_path or self.tokenizer.source,
            model_type=card.model_type,
            architectures=list(card.architectures),
            eos_token_ids=list(card.eos_token_ids),
            pad_token_id=card.pad_token_id,
            bos_token_id=card.bos_token_id,
            max_req_input_len=conversion.max_prompt_len(card),
        )

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(
            active_requests=self.active_requests,
            is_paused=False,
            last_receive_timestamp=self.last_receive_timestamp,
            uptime_seconds=time.time() - self.start_time,
            server_type="vllm-grpc",
            block_size=self.card.block_size,
            max_num_seqs=self.card.max_num_seqs,
            data_parallel_size=1,
            kv_cache_dtype="auto",
            model_dtype="torch.bfloat16",
        )

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GetLoadsResponse:
        response = pb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.UTC).isoformat(),
            version=f"kvswitch-{__version__}",
            dp_rank_count=1,
        )
        # One DP rank (0); a filter for another rank, or sections other than "core", get none.
        wanted_rank = not request.HasField("dp_rank") or request.dp_rank == 0
        sections = set(request.include)
        if wanted_rank and (not sections or sections & {"core", "all"}):
            response.loads.append(pb.SchedulerLoad(**scheduler_load_fields(self.engine.load())))
        return response

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext
                                ) -> AsyncIterator[common_pb2.KvEventBatch]:
        async for batch in self._kv_event_stream(request, context).run(self.draining):
            yield batch

    async def FlushCache(self, request: common_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        flushed = await self._flush_when_idle(request.timeout_s)
        message = ("Cache flushed." if flushed else
                   "Cache not flushed: requests are in flight; retry with a timeout_s.")
        logger.info("FlushCache: %s", message)
        return common_pb2.FlushCacheResponse(success=flushed, message=message)

    async def StartProfile(self, request: common_pb2.StartProfileRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        return common_pb2.ProfileResponse(
            success=True, message="Profiler started (simulated engine: nothing to profile).")

    async def StopProfile(self, request: common_pb2.StopProfileRequest,
                          context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        return common_pb2.ProfileResponse(
            success=True, message="Profiler stopped (simulated engine: no traces written).")
