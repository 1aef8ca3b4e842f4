"""One simulated replica of the fleet: the real simulator scheduler and KV cache, in virtual time.

`Replica` holds a `Scheduler` + `KvCacheManager` built from a `SimProfile` exactly as `SimEngine`
builds them, and does what `SimEngine`'s asyncio loop does, driven by the fleet's event queue:
a step starts (`Scheduler.step()`), lasts its `duration`, then its tokens are delivered and its
KV events published with a load snapshot. Publishing follows `kvswitch.engine.sim.events`:
a step's events are published at once when the coalescing window (default 50 ms) has passed
since the previous batch, else merged into a pending batch published when the window ends, with
the latest load; an engine publishes only when it has events or its (running, waiting) moved.

Per request it keeps the engine-side timings `SimEngine` logs (`RequestRecord`): arrival, queue
time (arrival to first scheduled step start), TTFT (arrival to the end of the step that produced
the first token), mean ITL and e2e, cached prompt tokens and preemptions.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvswitch.engine.base import (
    EngineLoadSnapshot,
    KvBlockStored,
    KvEventBatchData,
    SamplingOptions,
)
from kvswitch.engine.request_log import RequestRecord
from kvswitch.engine.sim.events import COALESCE_SECONDS, net_events
from kvswitch.engine.sim.kv_cache import KvCacheManager
from kvswitch.engine.sim.profiles import SimProfile
from kvswitch.engine.sim.request import SimSequence
from kvswitch.engine.sim.sampler import StopChecker, TokenSource
from kvswitch.engine.sim.scheduler import Scheduler, SchedulerLimits, StepResult
from kvswitch.engine.sim.structured import force_output

__all__ = ["Flight", "Replica"]

# Output tokens are drawn from this many ids; nothing reads them (ignore_eos, no stop strings).
_VOCAB = 150_000
_THROUGHPUT_WINDOW = 256  # steps, as SimEngine's generation-throughput estimate


@dataclass(slots=True)
class Flight:
    """One request in flight on a replica, and its engine-side timings."""

    request: Any
    """The workload's `BenchRequest`."""
    replica: int
    arrival: float
    seq: SimSequence
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    route_info: dict[str, Any] = field(default_factory=dict)
    """Whatever the router keeps with the request (e.g. the EPP's InferenceRequest)."""

    def record(self) -> RequestRecord:
        seq = self.seq
        end = self.last_token_at if self.last_token_at is not None else self.arrival
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        itl = None
        if self.tokens > 1 and self.first_token_at is not None:
            itl = (end - self.first_token_at) / (self.tokens - 1)
        return RequestRecord(
            request_id=str(self.request.index), arrival_wall=self.arrival, finish_wall=end,
            arrival=self.arrival, e2e_s=end - self.arrival, ttft_s=ttft,
            queue_s=None if self.scheduled_at is None else self.scheduled_at - self.arrival,
            itl_s=itl, prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=max(seq.num_cached_tokens, 0), completion_tokens=self.tokens,
            finish_reason=seq.finish_reason or "abort", stream=False,
            preemptions=seq.num_preemptions)


class Replica:
    """A simulated engine without asyncio: the fleet calls `add`, `start_step`, `end_step`."""

    def __init__(self, index: int, profile: SimProfile, seed: int = 0,
                 coalesce_seconds: float = COALESCE_SECONDS) -> None:
        self.index = index
        self.address = f"10.0.0.{index + 1}:8000"
        self.profile = p = profile
        self.kv = KvCacheManager(p.num_gpu_blocks, p.block_size)
        self.tokens = TokenSource("random", seed + index, _VOCAB, (), frozenset(), 256)
        self.scheduler = Scheduler(
            p, SchedulerLimits(p.max_num_seqs, p.max_num_batched_tokens, p.max_model_len),
            self.kv, self.tokens, StopChecker(None, p.max_model_len), _VOCAB)
        self.coalesce_seconds = coalesce_seconds
        self.current: tuple[StepResult, float] | None = None
        """The step running now and its start time; None when idle."""
        self.requests = 0
        # Coalescing (kvswitch.engine.sim.events.KvEventLog, without its asyncio timer).
        self.next_sequence_number = 0
        self._opened = -math.inf
        self._events: list[KvBlockStored | int] = []
        self._load: EngineLoadSnapshot | None = None
        self._timestamp = 0.0
        self.flush_due: float | None = None
        """When the pending batch's window ends (the fleet schedules the flush)."""
        self._last_load_key = (0, 0)
        self._window: deque[tuple[float, int]] = deque()
        self._window_tokens = 0

    # -- requests ------------------------------------------------------------------------------
    def add(self, request: Any, now: float) -> Flight:
        sampling = SamplingOptions(max_tokens=request.max_tokens, ignore_eos=True,
                                   temperature=0.0)
        seq = SimSequence(str(request.index), 0, list(request.prompt_ids), sampling,
                          request.max_tokens)
        self.tokens.init_sequence(seq, request.index, True)
        if request.answer_ids:  # the structured-output choice a multi-turn request carries
            force_output(seq, list(request.answer_ids))
        flight = Flight(request, self.index, now, seq)
        seq.owner = flight
        self.scheduler.add(seq)
        self.requests += 1
        return flight

    # -- steps ---------------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Run the next step if there is work; its end time, or None (idle)."""
        if not self.scheduler.has_work():
            return None
        result = self.scheduler.step()
        for seq in result.first_scheduled:
            seq.owner.scheduled_at = now
        self.current = (result, now)
        return now + result.duration

    def end_step(self, now: float) -> tuple[list[Flight], list[Flight]]:
        """Deliver the running step's tokens: (flights with their first token, finished)."""
        assert self.current is not None
        result, start = self.current
        self.current = None
        first: list[Flight] = []
        done: list[Flight] = []
        for seq in result.outputs:
            flight: Flight = seq.owner
            flight.tokens += 1
            flight.last_token_at = now
            if flight.first_token_at is None:
                flight.first_token_at = now
                first.append(flight)
            if seq.finish_reason is not None:
                done.append(flight)
        n = len(result.outputs)
        self._window.append((start, n))
        self._window_tokens += n
        if len(self._window) > _THROUGHPUT_WINDOW:
            self._window_tokens -= self._window.popleft()[1]
        return first, done

    # -- KV events and load -------------------------------------------------------------------
    def load(self, now: float) -> EngineLoadSnapshot:
        sched, p = self.scheduler, self.profile
        span = now - self._window[0][0] if self._window else 0.0
        return EngineLoadSnapshot(
            running=len(sched.running), waiting=len(sched.waiting),
            waiting_uncached_tokens=sched.waiting_uncached_tokens,
            used_blocks=self.kv.pool.num_used, total_blocks=p.num_gpu_blocks,
            block_size=p.block_size, max_running=p.max_num_seqs,
            gen_throughput=self._window_tokens / span if span > 0 else 0.0,
            cache_hit_rate=sched.prefix_hits / sched.prefix_queries if sched.prefix_queries
            else 0.0)

    def publish_step(self, now: float) -> KvEventBatchData | None:
        """SimEngine._publish_step then KvEventLog.publish: the batch when published now; None
        when nothing changed or it was merged into a pending batch (then `flush_due` is set)."""
        events, cleared = self.kv.pool.drain_events()
        sched = self.scheduler
        key = (len(sched.running), len(sched.waiting))
        if not (events or cleared or key != self._last_load_key):
            return None
        self._last_load_key = key
        self._events.extend(events)
        self._timestamp = now
        self._load = self.load(now)
        due = self._opened + self.coalesce_seconds
        if now >= due:
            return self._flush(now)
        if self.flush_due is None:
            self.flush_due = due
        return None

    def flush_window(self, due: float) -> KvEventBatchData | None:
        """The pending batch at the end of its window (None if it was published meanwhile)."""
        if self.flush_due != due:
            return None
        return self._flush(due)

    def _flush(self, opened_at: float) -> KvEventBatchData:
        self.flush_due = None
        stored, removed = net_events(self._events)
        batch = KvEventBatchData(self.next_sequence_number, self._timestamp, stored, removed,
                                 False, self._load)
        self._events = []
        self._load = None
        self._opened = opened_at
        self.next_sequence_number += 1
        return batch
