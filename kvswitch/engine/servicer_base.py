"""What the engine's gRPC servicers (vLLM's `servicer`, SGLang's `sglang_servicer`) share.

`ServicerBase` holds the serving state (active requests, last arrival, draining) and runs the
parts both APIs serve alike over the `Engine`: a Generate's update stream with its pacing,
metrics, request log and usage trailer; Embed; GetTokenizer; the KV-event stream;
waiting for the engine to idle before FlushCache. Each servicer converts its own protobufs.

Pacing: grpc.aio accepts a new RPC once per two event-loop iterations, so hundreds of streams
writing at every engine step would starve new calls. From 8 active requests on, each stream
reads the engine at most once per

    interval = min(max(active_requests x 20 µs, 1 ms), 50 ms)

sleeping only for what is left of it since its previous read; the backend merges the deltas
meanwhile, so tokens/s holds while messages/s stay bounded, and when engine steps are slower
than the interval no token is held back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Container, Iterable
from typing import Any, Protocol

import grpc

from kvswitch.engine.base import Engine, EngineLoadSnapshot, GenerationUpdate, engine_clock
from kvswitch.engine.kv_events import KvEventStream
from kvswitch.engine.metrics import EngineMetrics
from kvswitch.engine.request_log import RequestLog, RequestRecord
from kvswitch.engine.tokenizer_bundle import TokenizerArchive, build_tokenizer_archive
from kvswitch.errors import KvswitchError
from kvswitch.protocol import common_pb2
from kvswitch.protocol.headers import QUEUED_PROMPTS, USAGE_TRAILER
from kvswitch.tokenization import TokenizerBundle

logger = logging.getLogger(__name__)

PACE_FROM = 8  # active requests; below this, nothing to pace
_PACE_PER_STREAM = 20e-6
_PACE_MIN = 0.001  # the event loop's timer granularity
_PACE_MAX = 0.05
_FLUSH_POLL_SECONDS = 0.05


class ResponseBuilder(Protocol):
    """What the shared Generate loop needs from a servicer's response builder."""

    prompt_tokens: int
    cached_tokens: int

    def feed(self, update: GenerationUpdate) -> Iterable[Any]: ...

    def usage_trailer(self) -> str: ...


class ServicerBase:
    def __init__(self, engine: Engine, tokenizer: TokenizerBundle, *,
                 tokenizer_dir: str | None = None, metrics: EngineMetrics | None = None,
                 request_log: RequestLog | None = None):
        self.engine = engine
        self.card = engine.model
        self.tokenizer = tokenizer
        self.tokenizer_dir = tokenizer_dir
        self.metrics = metrics
        self.request_log = request_log
        """When set, one record per ended Generate (`kvswitch engine --request-log`)."""
        self._clock = engine_clock(engine)
        self.start_time = time.time()
        self.last_receive_timestamp = 0.0
        self.active_requests = 0
        self.draining = asyncio.Event()
        self._archive: TokenizerArchive | None = None
        self._archive_lock = asyncio.Lock()

    async def _stream_generate(self, context: grpc.aio.ServicerContext, request_id: str,
                               received: float, stream: bool,
                               updates: AsyncIterator[GenerationUpdate],
                               builder: ResponseBuilder, aborted: Container[str] = ()
                               ) -> AsyncGenerator[Any, None]:
        """The builder's messages for `updates`, paced; ends with the usage trailer, or aborts
        the call with the failure's status (INTERNAL "Request aborted" when the request's id is
        in `aborted` as it finishes)."""
        timer = RequestTimer(self.metrics, self._clock, track=self.request_log is not None)
        failure: KvswitchError | None = None
        self.active_requests += 1
        loop = asyncio.get_running_loop()
        last_read = 0.0
        try:
            async for update in updates:
                timer.update(update)
                if update.finished and request_id in aborted:
                    failure = KvswitchError("Request aborted")
                    break
                for message in builder.feed(update):
                    yield message
                if self.active_requests >= PACE_FROM and not update.finished:
                    now = loop.time()
                    wait = pace_interval(self.active_requests) - (now - last_read)
                    if wait >= _PACE_MIN:
                        await asyncio.sleep(wait)
                        now += wait
                    last_read = now
        except KvswitchError as exc:
            failure = exc
        except Exception as exc:
            logger.exception("Generate failed for request %s", request_id)
            failure = KvswitchError(str(exc) or type(exc).__name__)
        finally:
            # Closing the backend iterator aborts the request and frees its slot and blocks at
            # once: this runs on normal end, on error, and when a client cancel or an expired
            # deadline cancels the handler.
            self.active_requests -= 1
            close = getattr(updates, "aclose", None)
            if close is not None:
                await close()
            if self.request_log is not None:  # also when the client went away (cancelled)
                self.request_log.append(timer.record(
                    request_id, received, builder, stream,
                    "error" if failure is not None else None))
        trailer = ((USAGE_TRAILER, builder.usage_trailer()),)
        if failure is not None:
            await context.abort(failure.grpc_code, failure.message, trailing_metadata=trailer)
        timer.finish()
        context.set_trailing_metadata(trailer)

    async def _embed(self, context: grpc.aio.ServicerContext, request_id: str,
                     prompt: Callable[[], list[int]]) -> tuple[list[int], list[float]]:
        """(prompt ids, embedding) of the prompt `prompt()` reads from the request, with the
        usage trailer set; a failure aborts the call with its status."""
        self.last_receive_timestamp = time.time()
        self.active_requests += 1
        token_ids: list[int] = []
        try:
            token_ids = prompt()
            embedding = await self.engine.embed(request_id, token_ids)
        except KvswitchError as exc:
            await context.abort(exc.grpc_code, exc.message)
        except Exception as exc:
            logger.exception("Embed failed for request %s", request_id)
            await context.abort(grpc.StatusCode.INTERNAL, str(exc) or type(exc).__name__)
        finally:
            self.active_requests -= 1
        usage = f"prompt_tokens={len(token_ids)};completion_tokens=0;cached_tokens=0"
        context.set_trailing_metadata(((USAGE_TRAILER, usage),))
        return token_ids, embedding

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """The tokenizer archive in chunks, the last one carrying its sha256 (both APIs serve
        common.proto's GetTokenizer)."""
        async with self._archive_lock:
            if self._archive is None:
                # Deflating ~11 MB takes a moment: keep it off the event loop.
                self._archive = await asyncio.to_thread(
                    build_tokenizer_archive, self.tokenizer_dir, self.card, self.tokenizer)
        archive = self._archive
        chunks = archive.chunks()
        for i, data in enumerate(chunks):
            last = i == len(chunks) - 1
            yield common_pb2.GetTokenizerChunk(data=data, sha256=archive.sha256 if last else "")

    def _kv_event_stream(self, request: common_pb2.SubscribeKvEventsRequest,
                         context: grpc.aio.ServicerContext) -> KvEventStream:
        """The stream a SubscribeKvEvents call follows; its load pushes name the queued
        prompts when the caller asked (`QUEUED_PROMPTS` metadata, as kvswitch's EPPs do)."""
        metadata = context.invocation_metadata() or ()
        queued = any(k == QUEUED_PROMPTS and v == "1" for k, v in metadata)
        logger.info("SubscribeKvEvents from sequence %d", request.start_sequence_number)
        return KvEventStream(self.engine, request.start_sequence_number,
                             load_first=request.load_records_before_first_batch,
                             queued_prompts=queued)

    async def _flush_when_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for no running or waiting request, then flush the prefix
        cache; False when requests were still in flight or the engine refused."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            load = self.engine.load()
            idle = load.running == 0 and load.waiting == 0
            if idle or time.monotonic() >= deadline:
                break
            await asyncio.sleep(_FLUSH_POLL_SECONDS)
        return idle and await self.engine.flush_cache()


def pace_interval(active_requests: int) -> float:
    """Least seconds between a stream's reads of the engine while `active_requests` stream."""
    return min(max(active_requests * _PACE_PER_STREAM, _PACE_MIN), _PACE_MAX)


def scheduler_load_fields(load: EngineLoadSnapshot) -> dict[str, Any]:
    """The fields vLLM's and SGLang's `SchedulerLoad` share, for the one DP rank (0)."""
    return {
        "dp_rank": 0,
        "num_running_reqs": load.running,
        "num_waiting_reqs": load.waiting,
        "num_total_reqs": load.running + load.waiting,
        "num_used_tokens": load.used_tokens,
        "max_total_num_tokens": load.total_tokens,
        "token_usage": load.token_usage,
        "gen_throughput": load.gen_throughput,
        "cache_hit_rate": load.cache_hit_rate,
        "utilization": load.token_usage,
        "max_running_requests": load.max_running,
        "num_waiting_uncached_tokens": load.waiting_uncached_tokens,
    }


class RequestTimer:
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

    def record(self, request_id: str, arrival_wall: float, builder: ResponseBuilder,
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
