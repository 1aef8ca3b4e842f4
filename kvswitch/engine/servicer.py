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

Pacing: grpc.aio accepts a new RPC once per two event-loop iterations, and an iteration runs
every stream that has something to write, so with hundreds of streams writing every engine step
new RPCs starve (measured: ~40 accepted/s with 400 busy streams; with 128 streams at time scale
100 and no pacing, new calls were not admitted at all). Under load (from 8 active requests on)
each stream therefore reads the engine at most once per `active_requests x 20 µs` (1 to 50 ms);
the backend merges the deltas meanwhile, so tokens/s holds while messages/s, and the loop's
iteration length, stay bounded. Pacing is adaptive: a stream sleeps only for what is left of
that interval since its previous read, so when the engine's steps are slower than the interval
(e.g. time scale 1 with up to a few hundred streams) no token is held back at all.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from kvswitch import __version__
from kvswitch.engine import conversion
from kvswitch.engine.base import Engine, GenerationRequest, GenerationUpdate, engine_clock
from kvswitch.engine.kv_events import KvEventStream
from kvswitch.engine.metrics import EngineMetrics
from kvswitch.engine.request_log import RequestLog, RequestRecord
from kvswitch.engine.tokenizer_bundle import TokenizerArchive, build_tokenizer_archive
from kvswitch.errors import InvalidRequest, KvswitchError
from kvswitch.limits import SAMPLING_DEFAULTS, SamplingLimits
from kvswitch.protocol import common_pb2, vllm_engine_pb2_grpc
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.headers import USAGE_TRAILER
from kvswitch.tokenization import TokenizerBundle

logger = logging.getLogger(__name__)

_PACE_FROM = 8  # active requests; below this, nothing to pace
_PACE_PER_STREAM = 20e-6
_PACE_MIN = 0.001  # the event loop's timer granularity
_PACE_MAX = 0.05
_TOKENIZE_INLINE_CHARS = 16384  # longer text prompts are tokenized in a worker thread


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, engine: Engine, tokenizer: TokenizerBundle, *,
                 tokenizer_dir: str | None = None, metrics: EngineMetrics | None = None,
                 request_log: RequestLog | None = None,
                 limits: SamplingLimits = SAMPLING_DEFAULTS):
        self.engine = engine
        self.limits = limits
        self.request_log = request_log
        """When set, one record per ended Generate (`kvswitch engine --request-log`)."""
        self.card = engine.model
        self.tokenizer = tokenizer
        self.tokenizer_dir = tokenizer_dir
        self.metrics = metrics
        self._clock = engine_clock(engine)
        self.start_time = time.time()
        self.last_receive_timestamp = 0.0
        self.active_requests = 0
        self.draining = asyncio.Event()
        self._archive: TokenizerArchive | None = None
        self._archive_lock = asyncio.Lock()

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
        timer = _Timer(self.metrics, self._clock, track=self.request_log is not None)
        try:  # the backend checks the request against its model (max_model_len) here
            updates = self.engine.generate(GenerationRequest(
                request_id, prompt, sampling, received, incremental=request.stream))
        except KvswitchError as exc:
            await context.abort(exc.grpc_code, exc.message)
        failure: KvswitchError | None = None
        self.active_requests += 1
        loop = asyncio.get_running_loop()
        last_read = 0.0
        try:
            async for update in updates:
                timer.update(update)
                for message in builder.feed(update):
                    yield message
                if self.active_requests >= _PACE_FROM and not update.finished:
                    now = loop.time()
                    wait = _pace_interval(self.active_requests) - (now - last_read)
                    if wait >= _PACE_MIN:
                        await asyncio.sleep(wait)
                        now += wait
                    last_read = now
        except KvswitchError as exc:
            failure = exc
        except Exception as exc:
            logger.exception("Error in Generate for request %s", request_id)
            failure = KvswitchError(str(exc) or type(exc).__name__)
        finally:
            # Closing the backend iterator aborts the request and frees its slot and blocks at
            # once: this runs on normal end, on error, and when a client cancel or an expired
            # deadline cancels this handler.
            self.active_requests -= 1
            close = getattr(updates, "aclose", None)
            if close is not None:
                await close()
            if self.request_log is not None:  # also when the client went away (cancelled)
                self.request_log.append(timer.record(
                    request_id, received, builder, request.stream,
                    "error" if failure is not None else None))
        trailer = ((USAGE_TRAILER, builder.usage_trailer()),)
        if failure is not None:
            await context.abort(failure.grpc_code, failure.message, trailing_metadata=trailer)
        timer.finish()
        context.set_trailing_metadata(trailer)

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
        self.last_receive_timestamp = time.time()
        request_id = request.request_id or uuid.uuid4().hex
        logger.info("Embed request %s: input_type=tokenized", request_id)
        token_ids = list(request.tokenized.input_ids)
        self.active_requests += 1
        try:
            if not request.HasField("tokenized"):
                raise InvalidRequest("Embed requires tokenized input (tokenized.input_ids).",
                                     param="tokenized")
            conversion.check_prompt(token_ids, self.card)
            embedding = await self.engine.embed(request_id, token_ids)
        except KvswitchError as exc:
            await context.abort(exc.grpc_code, exc.message)
        except Exception as exc:
            logger.exception("Error in Embed for request %s", request_id)
            await context.abort(grpc.StatusCode.INTERNAL, str(exc) or type(exc).__name__)
        finally:
            self.active_requests -= 1
        usage = f"prompt_tokens={len(token_ids)};completion_tokens=0;cached_tokens=0"
        context.set_trailing_metadata(((USAGE_TRAILER, usage),))
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
            response.loads.append(scheduler_load(self.engine))
        return response

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        archive = await self._tokenizer_archive()
        chunks = archive.chunks()
        for i, data in enumerate(chunks):
            last = i == len(chunks) - 1
            yield common_pb2.GetTokenizerChunk(data=data, sha256=archive.sha256 if last else "")

    async def _tokenizer_archive(self) -> TokenizerArchive:
        async with self._archive_lock:
            if self._archive is None:
                # Deflating ~11 MB takes a moment: keep it off the event loop.
                self._archive = await asyncio.to_thread(
                    build_tokenizer_archive, self.tokenizer_dir, self.card, self.tokenizer)
            return self._archive

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext
                                ) -> AsyncIterator[common_pb2.KvEventBatch]:
        logger.info("SubscribeKvEvents from sequence %d", request.start_sequence_number)
        stream = KvEventStream(self.engine, request.start_sequence_number,
                               load_first=request.load_records_before_first_batch)
        async for batch in stream.run(self.draining):
            yield batch

    async def FlushCache(self, request: common_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        deadline = time.monotonic() + max(request.timeout_s, 0.0)
        while True:
            load = self.engine.load()
            idle = load.running == 0 and load.waiting == 0
            if idle or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        flushed = idle and await self.engine.flush_cache()
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


def _pace_interval(active_requests: int) -> float:
    """Least seconds between a stream's reads of the engine while `active_requests` stream."""
    return min(max(active_requests * _PACE_PER_STREAM, _PACE_MIN), _PACE_MAX)


def scheduler_load(engine: Engine) -> pb.SchedulerLoad:
    load = engine.load()
    return pb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=load.running,
        num_waiting_reqs=load.waiting,
        num_total_reqs=load.running + load.waiting,
        num_used_tokens=load.used_tokens,
        max_total_num_tokens=load.total_tokens,
        token_usage=load.token_usage,
        gen_throughput=load.gen_throughput,
        cache_hit_rate=load.cache_hit_rate,
        utilization=load.token_usage,
        max_running_requests=load.max_running,
        num_waiting_uncached_tokens=load.waiting_uncached_tokens,
    )


class _Timer:
    """Per-request latency observations on the engine's clock (`engine_clock`: simulated seconds
    for the simulator): TTFT, inter-token latency, e2e, queue time. A token's time is the one
    the engine stamped on its update (when it was produced), else when it was read here.
    With `track`, it also keeps what a `RequestRecord` needs (first token, tokens, finish)."""

    __slots__ = ("clock", "finish_reason", "first", "first_done", "last", "metrics",
                 "preemptions", "queue", "start", "tokens", "track")

    def __init__(self, metrics: EngineMetrics | None, clock: Callable[[], float],
                 track: bool = False):
        self.metrics = metrics
        self.clock = clock
        self.track = track
        self.start = self.last = clock()
        self.first_done = False
        self.first: float | None = None
        self.queue: float | None = None
        self.tokens = 0
        self.finish_reason: str | None = None
        self.preemptions: int | None = None

    def update(self, update: GenerationUpdate) -> None:
        if self.track:
            self._track(update)
        if self.metrics is None:
            return
        if update.queue_seconds is not None:
            self.metrics.queue_time.observe(update.queue_seconds)
        tokens = sum(len(s.token_ids) for s in update.sequences)
        now = self.clock() if update.time is None else update.time
        if not tokens:
            if update.finished:
                self.last = now
            return
        if not self.first_done:
            self.first_done = True
            first = now if update.first_token_time is None else update.first_token_time
            self.metrics.ttft.observe(first - self.start)
            if tokens > 1:  # a merged first update (non-streamed): its gaps after the first
                self.metrics.itl.observe((now - first) / (tokens - 1))
        else:
            # A merged delta of k tokens spans k inter-token gaps: observe their mean once.
            self.metrics.itl.observe((now - self.last) / tokens)
        self.last = now

    def _track(self, update: GenerationUpdate) -> None:
        if update.queue_seconds is not None:
            self.queue = update.queue_seconds
        if update.num_preemptions is not None:
            self.preemptions = update.num_preemptions
        tokens = sum(len(s.token_ids) for s in update.sequences)
        for s in update.sequences:
            if s.finish_reason is not None:
                self.finish_reason = s.finish_reason
        if tokens or update.finished:
            now = self.clock() if update.time is None else update.time
            if tokens and self.first is None:
                self.first = now if update.first_token_time is None else update.first_token_time
            self.tokens += tokens
            if self.metrics is None:
                self.last = now

    def finish(self) -> None:
        """The request ended with its last update: e2e is arrival to that update."""
        if self.metrics is not None:
            self.metrics.e2e.observe(self.last - self.start)

    def record(self, request_id: str, arrival_wall: float, builder: conversion.ResponseBuilder,
               stream: bool, failed: str | None) -> RequestRecord:
        """What `--request-log` writes for this request (call once it has ended)."""
        first, tokens = self.first, self.tokens
        return RequestRecord(
            request_id=request_id, arrival_wall=arrival_wall, finish_wall=time.time(),
            arrival=self.start, e2e_s=self.last - self.start,
            ttft_s=None if first is None else first - self.start, queue_s=self.queue,
            itl_s=(self.last - first) / (tokens - 1) if first is not None and tokens > 1
            else None,
            prompt_tokens=builder.prompt_tokens, cached_tokens=builder.cached_tokens,
            completion_tokens=tokens,
            finish_reason=failed or self.finish_reason or "abort", stream=stream,
            preemptions=self.preemptions)
