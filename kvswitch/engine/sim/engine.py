"""SimEngine: the `Engine` contract over the simulated scheduler.

A thin asyncio loop drives the sans-IO `Scheduler`: per step it computes the batch, sleeps the
step's simulated duration / time_scale of real time (or only yields when that is below the
timer granularity), then hands each new token to its request's `OutputStream` and publishes the
step's KV events with a load snapshot. Nothing here blocks on a consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

from kvswitch.engine.base import (
    EngineCounters,
    EngineLoadSnapshot,
    GenerationRequest,
    GenerationUpdate,
    KvEventBatchData,
    ModelCard,
    SamplingOptions,
)
from kvswitch.engine.sim.clock import SimClock
from kvswitch.engine.sim.config import SimConfig
from kvswitch.engine.sim.events import KvEventLog
from kvswitch.engine.sim.kv_cache import KvCacheManager
from kvswitch.engine.sim.output import OutputStream
from kvswitch.engine.sim.request import SimSequence
from kvswitch.engine.sim.sampler import StopChecker, TokenSource, prompt_logprobs
from kvswitch.engine.sim.scheduler import Scheduler, SchedulerLimits, StepResult
from kvswitch.engine.sim.structured import StructuredOutput, force_output
from kvswitch.errors import InternalError, InvalidRequest, Unavailable
from kvswitch.tokenization import load_tokenizer

__all__ = ["SimEngine"]

# Steps kept for the recent generation-throughput estimate.
_THROUGHPUT_WINDOW = 256


class _Request:
    __slots__ = ("abort_after_first", "request_id", "sequences", "stream")

    def __init__(self, request_id: str, sequences: list[SimSequence], stream: OutputStream) -> None:
        self.request_id = request_id
        self.sequences = sequences
        self.stream = stream
        self.abort_after_first = False


class SimEngine:
    """A vLLM-like engine whose GPU is a step-time model (see `kvswitch.engine.sim`)."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = cfg = config or SimConfig()
        self.profile = p = cfg.resolved_profile()
        self.tokenizer = bundle = load_tokenizer(cfg.tokenizer_dir)
        self._structured = StructuredOutput(bundle.encode)
        mc = bundle.model_config
        self.vocab_size = int(mc.get("vocab_size") or bundle.vocab_size)
        specials = bundle.special_token_ids
        ordinary = min(specials) if specials else bundle.vocab_size
        self.eos_token_ids = bundle.eos_token_ids
        self._model = ModelCard(
            served_model_name=cfg.served_model_name,
            model_path=cfg.served_model_name,
            tokenizer_path=bundle.source,
            max_model_len=p.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=tuple(self.eos_token_ids),
            bos_token_id=_id_or(bundle, bundle.config.get("bos_token")),
            pad_token_id=_id_or(bundle, bundle.config.get("pad_token")),
            embedding_dim=cfg.embedding_dim,
            model_type=str(mc.get("model_type", "qwen3")),
            architectures=tuple(mc.get("architectures", ("Qwen3ForCausalLM",))),
            block_size=p.block_size,
            num_gpu_blocks=p.num_gpu_blocks,
            max_num_seqs=p.max_num_seqs,
            max_num_batched_tokens=p.max_num_batched_tokens,
        )
        self._tokens = TokenSource(
            cfg.mode, cfg.seed, ordinary, self.eos_token_ids, specials, cfg.mean_output_len
        )
        self.kv = KvCacheManager(p.num_gpu_blocks, p.block_size)
        self.scheduler = Scheduler(
            p,
            SchedulerLimits(p.max_num_seqs, p.max_num_batched_tokens, p.max_model_len),
            self.kv,
            self._tokens,
            StopChecker(bundle, p.max_model_len),
            self.vocab_size,
        )
        self.clock = SimClock(cfg.time_scale)
        self._events = KvEventLog(cfg.kv_event_history,
                                  coalesce_seconds=cfg.kv_events_coalesce_seconds,
                                  max_events=cfg.kv_event_history_events,
                                  load_push_seconds=cfg.kv_load_push_seconds,
                                  block_size=p.block_size, prefilling=self._prefilling)
        self._requests: dict[str, _Request] = {}
        self._failures = random.Random(cfg.seed)
        self._finished: dict[str, int] = {}
        self._window: deque[tuple[float, int]] = deque()
        self._window_tokens = 0
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._running = False
        self._last_load_key: tuple[int, int] = (0, 0)

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def model(self) -> ModelCard:
        return self._model

    async def start(self) -> None:
        if self._task is None:
            self._running = True
            self._task = asyncio.create_task(self._loop(), name="kvswitch-sim-scheduler")

    async def stop(self) -> None:
        self._running = False
        await self.abort(list(self._requests))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._events.close()

    def is_healthy(self) -> bool:
        return self._running and self._task is not None and not self._task.done()

    # -- generation --------------------------------------------------------------------------
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        prompt = self._validate(request)
        return self._generate(request, prompt)

    def _validate(self, request: GenerationRequest) -> list[int]:
        s, p = request.sampling, self.profile
        if not self._running:
            raise Unavailable("the engine is not running")
        if request.request_id in self._requests:
            raise InvalidRequest(
                f"request id {request.request_id!r} is already in use", param="request_id"
            )
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise InvalidRequest(
                f"token id {bad} is out of vocabulary (size {self.vocab_size})", param="prompt"
            )
        if s.n < 1:
            raise InvalidRequest(f"n must be at least 1, got {s.n}", param="n")
        if s.max_tokens is not None and s.max_tokens < 1:
            raise InvalidRequest(
                f"max_tokens must be at least 1, got {s.max_tokens}", param="max_tokens"
            )
        wanted = max(s.max_tokens or 1, s.min_tokens, 1)
        if len(prompt) + wanted > p.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {p.max_model_len} tokens. However, you "
                f"requested {len(prompt) + wanted} tokens ({len(prompt)} in the prompt, {wanted} "
                "for the completion).",
                param="max_tokens" if s.max_tokens else "prompt",
            )
        for name, value in (("logprobs", s.logprobs), ("prompt_logprobs", s.prompt_logprobs)):
            if value is not None and value > self.config.max_logprobs:
                raise InvalidRequest(
                    f"{name} {value} exceeds the maximum allowed {self.config.max_logprobs}",
                    param=name,
                )
        return prompt

    async def _generate(
        self, request: GenerationRequest, prompt: list[int]
    ) -> AsyncIterator[GenerationUpdate]:
        rid = request.request_id
        cfg = self.config
        injected = cfg.failure_rate > 0 and self._failures.random() < cfg.failure_rate
        if injected and cfg.failure_kind == "internal":
            raise InternalError(f"injected engine failure for request {rid}")
        if injected and cfg.failure_kind == "unavailable":
            raise Unavailable(f"injected unavailability for request {rid}")
        if rid in self._requests:  # raced with another generate() between validate and now
            raise InvalidRequest(f"request id {rid!r} is already in use", param="request_id")
        req = self._admit(request, prompt)
        req.abort_after_first = injected
        try:
            while True:
                update = await req.stream.get()
                yield update
                if update.finished:
                    return
        finally:
            # Closed or cancelled before the end: free the batch slot and blocks right now.
            self._drop(req)

    def make_sequences(self, request: GenerationRequest) -> list[SimSequence]:
        """The request's n sequences, seeded and with their stop rules, not yet scheduled."""
        s, prompt = request.sampling, list(request.prompt_token_ids)
        max_tokens = (
            s.max_tokens if s.max_tokens is not None else self.profile.max_model_len - len(prompt)
        )
        prompt_key = hash(tuple(prompt))
        seqs = []
        for i in range(s.n):
            # vLLM names the children of an n > 1 request "{index}_{request_id}".
            sid = request.request_id if s.n == 1 else f"{i}_{request.request_id}"
            seq = SimSequence(sid, i, prompt, s, max_tokens)
            self._set_stops(seq, s)
            self._tokens.init_sequence(seq, prompt_key, s.max_tokens is not None)
            if s.constraint is not None:  # InvalidRequest when the simulator cannot emit it
                force_output(seq, self._structured.token_ids(s.constraint))
            seqs.append(seq)
        return seqs

    def _admit(self, request: GenerationRequest, prompt: list[int]) -> _Request:
        s = request.sampling
        seqs = self.make_sequences(request)
        plp = (
            None
            if s.prompt_logprobs is None
            else prompt_logprobs(prompt, s.prompt_logprobs, self.vocab_size)
        )
        # Leave idle now, so the request's arrival (and its first step) is at this instant of
        # simulated time, not one event-loop wake-up x time_scale later.
        self.clock.resume()
        arrival = self.clock.at_real_time()
        stream = OutputStream(request.request_id, seqs, plp, arrival,
                              final_only=not request.incremental)
        req = _Request(request.request_id, seqs, stream)
        for seq in seqs:
            seq.owner = req
            self.scheduler.add(seq)
        self._requests[request.request_id] = req
        self._wake()
        self._events.arrived(request.request_id, prompt)
        return req

    def _set_stops(self, seq: SimSequence, s: SamplingOptions) -> None:
        # vLLM: the first eos ends with no stop reason; other eos ids (generation config) join
        # stop_token_ids and are reported as the matched stop. ignore_eos disables both.
        eos = self.eos_token_ids
        seq.eos_id = eos[0] if eos and not s.ignore_eos else -1
        extra = eos[1:] if not s.ignore_eos else ()
        seq.stop_ids = frozenset(s.stop_token_ids) | frozenset(extra)

    def _drop(self, req: _Request) -> None:
        if self._requests.get(req.request_id) is req:
            self._events.ended(req.request_id)  # while `_prefilling` still knows it
            del self._requests[req.request_id]
        for seq in req.sequences:
            if self.scheduler.abort(seq):
                self._count_finished("abort")

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is not None:
                self._abort_request(req)

    def _abort_request(self, req: _Request) -> None:
        for seq in req.sequences:
            if self.scheduler.abort(seq):
                self._count_finished("abort")
                req.stream.push_finish(seq, "abort", self.clock.at_real_time())

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def _prefilling(self, request_id: str) -> bool:
        """The request has produced no output token yet: its prompt's blocks are not stored."""
        req = self._requests.get(request_id)
        return req is not None and not req.stream.first_token_sent

    def _count_finished(self, reason: str) -> None:
        self._finished[reason] = self._finished.get(reason, 0) + 1

    # -- the loop ----------------------------------------------------------------------------
    def _wake(self) -> None:
        w, self._wakeup = self._wakeup, None
        if w is not None and not w.done():
            w.set_result(None)

    async def _loop(self) -> None:
        try:
            await self._run_steps()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a simulator bug: fail every stream rather than hang them
            self._running = False
            error = InternalError(f"simulated engine failed: {exc!r}")
            for req in list(self._requests.values()):
                req.stream.fail(error)
            raise

    async def _run_steps(self) -> None:
        sched, clock = self.scheduler, self.clock
        while True:
            if not sched.has_work():
                clock.pause()
                self._publish_step()
                self._wakeup = asyncio.get_running_loop().create_future()
                await self._wakeup
                clock.resume()
                continue
            start = clock.now()
            result = sched.step()
            delay = clock.advance(result.duration)
            # Always yield, even when the step is "free" at a large time_scale.
            await asyncio.sleep(delay)
            self._deliver(result, start)
            self._publish_step()

    def _deliver(self, result: StepResult, start: float) -> None:
        count = self._count_finished
        for seq in result.first_scheduled:
            seq.owner.stream.mark_scheduled(start)
        end = start + result.duration
        for seq in result.outputs:
            req = seq.owner
            req.stream.push(seq, end)
            if seq.finish_reason is not None:
                count(seq.finish_reason)
            elif req.abort_after_first:
                self._abort_request(req)
        n = len(result.outputs)
        self._window.append((start, n))
        self._window_tokens += n
        if len(self._window) > _THROUGHPUT_WINDOW:
            self._window_tokens -= self._window.popleft()[1]

    def _publish_step(self) -> None:
        events, cleared = self.kv.pool.drain_events()
        sched = self.scheduler
        key = (len(sched.running), len(sched.waiting))
        if events or cleared or key != self._last_load_key:
            self._last_load_key = key
            # Wall-clock time, as vLLM stamps its batches (consumers compare it with their
            # own clock).
            self._events.publish(time.time(), events, cleared=cleared, load=self.load())

    # -- state -------------------------------------------------------------------------------
    def now(self) -> float:
        """Simulated seconds since start (the `Engine.now` clock the servicer times with)."""
        return self.clock.at_real_time()

    def load(self) -> EngineLoadSnapshot:
        sched, p = self.scheduler, self.profile
        return EngineLoadSnapshot(
            running=len(sched.running),
            waiting=len(sched.waiting),
            waiting_uncached_tokens=sched.waiting_uncached_tokens,
            used_blocks=self.kv.pool.num_used,
            total_blocks=p.num_gpu_blocks,
            block_size=p.block_size,
            max_running=p.max_num_seqs,
            gen_throughput=self._gen_throughput(),
            cache_hit_rate=sched.prefix_hits / sched.prefix_queries
            if sched.prefix_queries
            else 0.0,
        )

    def _gen_throughput(self) -> float:
        """Output tokens / simulated seconds since the start of the oldest step in the window."""
        if not self._window:
            return 0.0
        span = self.clock.now() - self._window[0][0]
        return self._window_tokens / span if span > 0 else 0.0

    def counters(self) -> EngineCounters:
        s = self.scheduler
        return EngineCounters(
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits,
            preemptions=s.preemptions,
            requests_finished=dict(self._finished),
            load_pushes=self._events.load_pushes,
        )

    def kv_events(self, start_sequence_number: int = 0) -> AsyncIterator[KvEventBatchData]:
        return self._events.follow(start_sequence_number)

    async def flush_cache(self) -> bool:
        if self.scheduler.has_work() or not self.kv.pool.reset():
            return False
        self._publish_step()
        return True

    async def embed(self, request_id: str, token_ids: Sequence[int]) -> list[float]:
        """A deterministic unit vector: Gaussian components seeded by the token ids, divided by
        their L2 norm. Takes one prefill step's simulated time."""
        ids = list(token_ids)
        if not ids:
            raise InvalidRequest("the input is empty", param="input")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequest(f"token ids must be in [0, {self.vocab_size})", param="input")
        if len(ids) > self.profile.max_model_len:
            raise InvalidRequest(
                f"the input has {len(ids)} tokens, more than max_model_len "
                f"{self.profile.max_model_len}",
                param="input",
            )
        rng = random.Random(hash(tuple(ids)))
        vec = [rng.gauss(0.0, 1.0) for _ in range(self.config.embedding_dim)]
        norm = math.sqrt(sum(x * x for x in vec)) or 1.0
        n = len(ids)
        step = self.profile.step_seconds(n, 0, prefill_context=n, prefill_pairs=n * (n + 1) // 2)
        await asyncio.sleep(step / self.config.time_scale)
        return [x / norm for x in vec]


def _id_or(bundle: object, token: object) -> int:
    from kvswitch.tokenization.bundle import special_token_text

    text = special_token_text(token)
    tid = bundle.token_id(text) if text else None  # type: ignore[attr-defined]
    return -1 if tid is None else int(tid)
