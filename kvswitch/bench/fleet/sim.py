"""The fleet's discrete-event loop: arrivals, replica steps, KV-event batches, router timers.

One heap of (virtual time, sequence, callback); same-time events run in the order they were
scheduled, so every arrival already due runs before a replica's step at that instant (a burst lands
in one step's waiting queue, as on a real engine that wakes after the arrivals). A conversation's
next turn (`previous` set) arrives at its time or when its previous turn ends (finished or
rejected), whichever is later, and a replica says a request's `answer_ids` (the structured-output
choice it carries). A replica's step runs `Scheduler.step()` when it starts and delivers its tokens
when it ends (start + its `duration`), then publishes its KV events (`Replica.publish_step`); a
pending coalesced batch gets a flush at its window's end. With a router holding two or more KV-event
streams per replica (several EPPs), an arrival makes its replica push its load `load_push_seconds`
later (at least `PUSH_INTERVAL_SECONDS` after its previous push), as `kvswitch.engine.sim.events`
does (arrivals while a push is pending ride on it; a push whose routing core repeats the last load
the replica delivered is not sent, as `kvswitch.engine.kv_events` does), with the prompts of the
requests that arrived since the previous push whose prefill has not ended (`queued_prompts`; such a
push always goes out). `on_step(replica, start, step)`, when given, sees each replica step (a
`StepResult`: its duration, batch and outputs) as it starts, with the replica's waiting queue and KV
cache then. The run ends when every request has finished or was rejected (then its timers run one
more `REPORT_SECONDS`, so reports on their way arrive), or at `limit` virtual seconds (the rest are
reported unfinished).
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvswitch.bench.engine_report import step_summary
from kvswitch.bench.fleet.replica import Flight, Replica
from kvswitch.bench.fleet.routers import FleetRouter
from kvswitch.engine.base import KvEventBatchData
from kvswitch.engine.request_log import RequestRecord
from kvswitch.engine.sim.events import (
    COALESCE_SECONDS,
    LOAD_PUSH_SECONDS,
    PromptQueue,
    next_push_at,
)
from kvswitch.engine.sim.profiles import SimProfile
from kvswitch.engine.sim.scheduler import StepResult


@dataclass
class FleetResult:
    router: str
    steps: list[dict[str, Any]]
    """Per workload stage: `engine_report.step_summary` plus its rate, per-replica counts."""
    overall: dict[str, Any]
    requests_per_replica: list[int]
    records: list[RequestRecord] = field(repr=False)
    replica_of: dict[str, int] = field(repr=False)
    rejected: list[tuple[int, str]] = field(default_factory=list)
    unfinished: list[int] = field(default_factory=list)
    sim_seconds: float = 0.0
    wall_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"router": self.router, "steps": self.steps, "overall": self.overall,
                "requests_per_replica": self.requests_per_replica,
                "rejected": [{"index": i, "reason": r} for i, r in self.rejected],
                "unfinished": self.unfinished, "sim_seconds": self.sim_seconds,
                "wall_seconds": self.wall_seconds}


REPORT_SECONDS = 1.0
"""After the last request ends, how long the loop still runs timers, so ends still buffered
(the gateway's access log) reach the router."""


class _Fleet:
    """The `FleetContext` routers see, and the loop."""

    def __init__(self, requests: Sequence[Any], profile: SimProfile, replicas: int,
                 router: FleetRouter, seed: int, coalesce_seconds: float,
                 load_push_seconds: float = LOAD_PUSH_SECONDS,
                 queued_prompts: bool = True,
                 on_step: Callable[[Replica, float, StepResult], None] | None = None) -> None:
        self.requests = requests
        self.on_step = on_step
        self.profile = profile
        self.replicas = [Replica(i, profile, seed, coalesce_seconds) for i in range(replicas)]
        self.router = router
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._now = 0.0
        self._woken = [False] * replicas
        self._flush_at: list[float | None] = [None] * replicas
        self.load_push_seconds = load_push_seconds
        self._push_pending = [False] * replicas
        self._pushed_at = [-math.inf] * replicas
        self.queued_prompts = queued_prompts
        self._queued = [PromptQueue(profile.block_size) for _ in range(replicas)]
        self._delivered: list[tuple[int, int, int, float] | None] = [None] * replicas
        """Per replica, the routing core of the last load it delivered (batch or push)."""
        self.flights: dict[int, Flight] = {}
        self.records: list[RequestRecord] = []
        self.replica_of: dict[str, int] = {}
        self.rejected: list[tuple[int, str]] = []
        self.remaining = len(requests)
        self._ended: set[int] = set()
        self._after: dict[int, list[Any]] = {}
        self.ended_at = 0.0

    # -- FleetContext -----------------------------------------------------------------------
    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self._now), next(self._order), callback))

    def dispatch(self, request: Any, replica: int) -> None:
        rep = self.replicas[replica]
        self.flights[request.index] = rep.add(request, self._now)
        if rep.current is None and not self._woken[replica]:
            self._woken[replica] = True
            self.call_at(self._now, lambda: self._step(replica))
        if self.load_push_seconds <= 0 or self.router.kv_subscribers < 2:
            return
        if self.queued_prompts:
            self._queued[replica].add(str(request.index), request.prompt_ids)
        if not self._push_pending[replica]:
            self._push_pending[replica] = True
            self.call_at(next_push_at(self._now, self._pushed_at[replica],
                                      self.load_push_seconds), lambda: self._push(replica))

    def reject(self, request: Any, reason: str) -> None:
        self.rejected.append((request.index, reason))
        self.remaining -= 1
        self._end(request.index)

    # -- events ------------------------------------------------------------------------------
    def _arrive(self, request: Any) -> None:
        if request.previous >= 0 and request.previous not in self._ended:
            # A conversation's next turn waits for its previous turn to end.
            self._after.setdefault(request.previous, []).append(request)
            return
        pick = self.router.route(request, self._now)
        if pick is not None:
            self.dispatch(request, pick)

    def _step(self, i: int) -> None:
        rep, now = self.replicas[i], self._now
        self._woken[i] = False
        if rep.current is not None:
            first, done = rep.end_step(now)
            for flight in first:
                self.router.first_token(flight.request, i, now)
            for flight in done:
                self._finish(flight)
            self._publish(i)
        end = rep.start_step(now)
        if end is None:
            self._publish(i)
        else:
            if self.on_step is not None and rep.current is not None:
                self.on_step(rep, now, rep.current[0])
            self.call_at(end, lambda: self._step(i))

    def _finish(self, flight: Flight) -> None:
        request = flight.request
        del self.flights[request.index]
        record = flight.record()
        self.records.append(record)
        self.replica_of[record.request_id] = flight.replica
        self.remaining -= 1
        self.router.finished(request, flight.replica, self._now)
        self._end(request.index)

    def _end(self, index: int) -> None:
        self._ended.add(index)
        for later in self._after.pop(index, ()):
            self.call_at(self._now, functools.partial(self._arrive, later))

    def _publish(self, i: int) -> None:
        rep = self.replicas[i]
        batch = rep.publish_step(self._now)
        if batch is not None:
            self._deliver(i, batch)
        elif rep.flush_due is not None and self._flush_at[i] != rep.flush_due:
            due = self._flush_at[i] = rep.flush_due
            self.call_at(due, lambda: self._flush(i, due))

    def _push(self, i: int) -> None:
        self._push_pending[i] = False
        self._pushed_at[i] = self._now
        load = self.replicas[i].load(self._now)
        queued = self._queued[i].take(lambda request_id: self._prefilling(int(request_id)))
        if queued or load.routing_core != self._delivered[i]:
            self._delivered[i] = load.routing_core
            self.router.load_push(i, load, self._now, queued)

    def _prefilling(self, index: int) -> bool:
        """Request `index` has produced no output token yet (its blocks are not stored)."""
        flight = self.flights.get(index)
        return flight is not None and flight.first_token_at is None

    def _flush(self, i: int, due: float) -> None:
        batch = self.replicas[i].flush_window(due)
        if batch is not None:
            self._deliver(i, batch)

    def _deliver(self, i: int, batch: KvEventBatchData) -> None:
        self._delivered[i] = batch.load.routing_core if batch.load is not None else None
        self.router.kv_batch(i, batch, self._now)

    def run(self, limit: float, progress: Callable[[int], None] | None) -> None:
        for request in self.requests:
            self.call_at(request.send_at, functools.partial(self._arrive, request))
        self.router.setup(self)
        heap, done = self._heap, 0
        while heap and self.remaining > 0:
            when, _, callback = heapq.heappop(heap)
            if when > limit:
                break
            self._now = when
            callback()
            if progress is not None and len(self.records) != done:
                progress(len(self.records) - done)
                done = len(self.records)
        self.ended_at = self._now
        # What is already on its way (ends in the gateway's log buffer) still reaches the
        # router, so its state ends settled: one more second of timers, no new work.
        quiet = self._now + REPORT_SECONDS
        while heap and heap[0][0] <= quiet and self.remaining <= 0:
            when, _, callback = heapq.heappop(heap)
            self._now = when
            callback()


async def _run_in_loop(fleet: _Fleet, limit: float,
                       progress: Callable[[int], None] | None) -> None:
    fleet.run(limit, progress)


def run_fleet(workload: Any, router: FleetRouter, profile: SimProfile, replicas: int = 8, *,
              seed: int = 0, coalesce_seconds: float = COALESCE_SECONDS,
              load_push_seconds: float = LOAD_PUSH_SECONDS, queued_prompts: bool = True,
              drain_limit: float = 600.0,
              progress: Callable[[int], None] | None = None,
              on_step: Callable[[Replica, float, StepResult], None] | None = None) -> FleetResult:
    """Replay `workload.requests` (send_at, prompt_ids, max_tokens, stage, qps) through `router`
    onto `replicas` simulated engines of `profile`; deterministic for a seed. The run stops
    `drain_limit` virtual seconds after the last arrival at the latest."""
    requests = list(workload.requests)
    fleet = _Fleet(requests, profile, replicas, router, seed, coalesce_seconds,
                   load_push_seconds, queued_prompts, on_step)
    last = max((r.send_at for r in requests), default=0.0)
    started = time.perf_counter()
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        # The EPP's flow-control gate queues a request on an asyncio future: give it a loop
        # (the run itself never awaits; held requests are resumed by the router).
        asyncio.run(_run_in_loop(fleet, last + drain_limit, progress))
    else:
        fleet.run(last + drain_limit, progress)
    wall = time.perf_counter() - started
    stages = sorted({r.stage for r in requests})
    rate = {r.stage: r.qps for r in requests}
    by_stage: dict[int, list[RequestRecord]] = {s: [] for s in stages}
    stage_of = {str(r.index): r.stage for r in requests}
    for record in fleet.records:
        by_stage[stage_of[record.request_id]].append(record)
    steps = []
    for s in stages:
        counts = [0] * replicas
        for record in by_stage[s]:
            counts[fleet.replica_of[record.request_id]] += 1
        steps.append({"stage": s, "qps": rate[s], **step_summary(by_stage[s], 0.0, 1.0),
                      "requests_per_replica": counts})
    rejected = {i for i, _ in fleet.rejected}
    unfinished = [r.index for r in requests
                  if str(r.index) not in fleet.replica_of and r.index not in rejected]
    return FleetResult(
        router=router.name, steps=steps, overall=step_summary(fleet.records, 0.0, 1.0),
        requests_per_replica=[r.requests for r in fleet.replicas], records=fleet.records,
        replica_of=fleet.replica_of, rejected=fleet.rejected, unfinished=unfinished,
        sim_seconds=fleet.ended_at, wall_seconds=wall)
