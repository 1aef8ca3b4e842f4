"""KV event batches: numbering, a bounded history for replay, and live followers.

Every published batch gets the next sequence number (from 0). The log keeps the last
`capacity` batches holding at most `max_events` block events between them (the newest batch
always); `follow(start)` replays those numbered >= start (from the oldest still held if start
is older), then yields new ones as they are published. All followers share one future that the
next `publish` resolves, so a batch costs O(1) whatever the follower count. The event bound
keeps replay memory near 45 MB under load; a follower that falls further behind sees a gap in
the numbering and resyncs, as after any lost batch.

Within a batch no block hash is both stored and removed: events are folded to their net effect
(the last event per hash wins), so a consumer may apply `removed` and `stored` in either order.

Coalescing (`coalesce_seconds`, default 50 ms; 0 publishes every call): a call at least
`coalesce_seconds` after the previous batch is published at once; later calls inside that
window, load moves included, merge in order into one pending batch that a timer publishes when
the window ends, with the latest load. A clear is published at once (dropping the pending
events it supersedes). A merged batch takes one number, so each subscriber gets at most one
batch per window from each engine and the load it sees is at most one window old
(docs/benchmarks/epp-cpu.md has the measurements behind the window).

Load push (`load_push_seconds`, default 1 ms; 0 disables): `arrived()` says a request reached
the engine. With two or more followers (several EPPs, each seeing only its own sends), the log
yields every follower a load-only item (a push) that long after the arrival, or
`PUSH_INTERVAL_SECONDS` (5 ms) after the previous push if that is later, so each EPP learns of
the others' sends within a few ms rather than within a window; arrivals while a push is pending
ride on it, so there is at most one push per interval however high the arrival rate. A push also
carries the prompts of the requests that arrived since the previous one (`QueuedPrompt`: their
full blocks, at most `QUEUED_PROMPTS` prompts and `QUEUED_TOKENS` tokens per push; later ones
go unannounced), so every EPP learns where a prompt's blocks will be stored before the engine
schedules it. Only requests whose prefill has not ended when the push fires (`prefilling`: no
output token yet) are announced: one past its prefill has had its blocks stored, on their way in
the next batch, and announcing it would defeat the stream's skip of pushes that repeat its last
load (a short request on a fast engine is past its prefill within the push delay). The sending
EPP keeps counting its own send until a report sampled its transit allowance (5 ms) after it,
so for a few ms it counts the request on the push and on its own account both. A follower that
fell behind gets the last `PUSH_HISTORY` pushes it missed.
An announced request that leaves the engine before its prefill ends (`ended()`: a client's
cancel while it is queued, an abort, a failure) is withdrawn: a push soon after names its id
(`KvEventBatchData.withdrawn`, at most `QUEUED_PROMPTS` ids per push, the rest on the next), so
the EPPs that counted its prefill stop counting it instead of waiting for blocks that never
come. The ids awaiting that are bounded by the requests the engine holds.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

from kvswitch.engine.base import EngineLoadSnapshot, KvBlockStored, KvEventBatchData, QueuedPrompt

__all__ = ["COALESCE_SECONDS", "LOAD_PUSH_SECONDS", "MAX_EVENTS", "PUSH_INTERVAL_SECONDS",
           "QUEUED_PROMPTS", "QUEUED_TOKENS", "KvEventLog", "PromptQueue", "net_events",
           "next_push_at"]

COALESCE_SECONDS = 0.05
LOAD_PUSH_SECONDS = 0.001
PUSH_INTERVAL_SECONDS = 0.005
QUEUED_PROMPTS = 64
QUEUED_TOKENS = 131_072
PUSH_HISTORY = 8


def next_push_at(arrived_at: float, last_push_at: float, delay: float) -> float:
    """When the push for an arrival at `arrived_at` fires: `delay` later, but at least
    `PUSH_INTERVAL_SECONDS` after the previous push (at `last_push_at`)."""
    return max(arrived_at + delay, last_push_at + PUSH_INTERVAL_SECONDS)


class PromptQueue:
    """The prompts the next push announces: each arrival's full blocks, within the bounds."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._prompts: list[QueuedPrompt] = []
        self._tokens = 0

    def add(self, request_id: str, prompt: Sequence[int]) -> None:
        full = len(prompt) - len(prompt) % self.block_size
        if (full and len(self._prompts) < QUEUED_PROMPTS
                and self._tokens + full <= QUEUED_TOKENS):
            self._prompts.append(QueuedPrompt(request_id, tuple(prompt[:full])))
            self._tokens += full

    def take(self, prefilling: Callable[[str], bool] | None) -> tuple[QueuedPrompt, ...]:
        """The prompts added since the last take whose request is still `prefilling`."""
        prompts, self._prompts, self._tokens = self._prompts, [], 0
        return tuple(q for q in prompts if prefilling is None or prefilling(q.request_id))


def net_events(
    events: Sequence[KvBlockStored | int],
) -> tuple[tuple[KvBlockStored, ...], tuple[int, ...]]:
    """Split an ordered event list (KvBlockStored, or an int = removed hash) into stored and
    removed, keeping only the last event per hash when a hash occurs twice."""
    stored = [e for e in events if not isinstance(e, int)]
    removed = [e for e in events if isinstance(e, int)]
    if not stored or not removed:
        return tuple(stored), tuple(removed)
    last: dict[int, KvBlockStored | int] = {}
    for e in events:
        last[e if isinstance(e, int) else e.block_hash] = e
    return (
        tuple(e for e in last.values() if not isinstance(e, int)),
        tuple(e for e in last.values() if isinstance(e, int)),
    )


MAX_EVENTS = 65_536


class KvEventLog:
    def __init__(self, capacity: int = 4096, coalesce_seconds: float = COALESCE_SECONDS,
                 max_events: int = MAX_EVENTS,
                 load_push_seconds: float = LOAD_PUSH_SECONDS, block_size: int = 16,
                 prefilling: Callable[[str], bool] | None = None) -> None:
        self.history: deque[KvEventBatchData] = deque(maxlen=max(1, capacity))
        self.max_events = max_events
        self.held_events = 0
        """Block events (stored + removed) in `history`."""
        self.next_sequence_number = 0
        self.coalesce_seconds = coalesce_seconds
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._published_at = -math.inf
        """Timestamp the current coalescing window opened at (the last batch's)."""
        self._events: list[KvBlockStored | int] = []
        self._cleared = False
        self._load: EngineLoadSnapshot | None = None
        self._timestamp = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.load_push_seconds = load_push_seconds
        self.followers = 0
        self.load_pushes = 0
        """Load pushes made so far (a follower yields the pushes it has not yielded yet)."""
        self._push_timer: asyncio.TimerHandle | None = None
        self._pushed_at = -math.inf
        """Loop time of the last push."""
        self._pushes: deque[KvEventBatchData] = deque(maxlen=PUSH_HISTORY)
        self.prefilling = prefilling
        """Whether a request's prefill has not ended yet (None: every arrival's has not)."""
        self._queued = PromptQueue(block_size)
        self._announced: set[str] = set()
        """Ids a push announced whose request has not ended (`ended()`)."""
        self._withdrawn: list[str] = []

    def publish(
        self,
        timestamp: float,
        events: Sequence[KvBlockStored | int] = (),
        *,
        cleared: bool = False,
        load: EngineLoadSnapshot | None = None,
    ) -> KvEventBatchData | None:
        """One step's events: the batch when published now, None when merged into a pending
        one (see the module docstring)."""
        if cleared:
            self._events.clear()  # a clear supersedes what came before it
            self._cleared = True
        self._events.extend(events)
        self._timestamp = timestamp
        if load is not None:
            self._load = load
        due = self._published_at + self.coalesce_seconds
        if cleared or timestamp >= due:
            return self._flush(timestamp)
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return self._flush(timestamp)  # no loop to flush later: publish now
            self._timer = loop.call_later(due - timestamp, self._flush_window, due)
        return None

    def arrived(self, request_id: str = "", prompt: Sequence[int] = ()) -> None:
        """A request reached the engine: push the load soon, with the request's prompt, if
        several follow (see the module docstring)."""
        if self.load_push_seconds <= 0 or self.followers < 2 or self._closed:
            return
        self._queued.add(request_id, prompt)
        self._schedule_push()

    def ended(self, request_id: str) -> None:
        """A request is leaving the engine (`prefilling` still knows it): withdraw it on the
        next push if a push announced it and its prefill has not ended."""
        if request_id not in self._announced:
            return
        self._announced.discard(request_id)
        if self._closed or (self.prefilling is not None and not self.prefilling(request_id)):
            return
        self._withdrawn.append(request_id)
        self._schedule_push()

    def _schedule_push(self) -> None:
        if self._push_timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # nobody can be following without a loop
        now = loop.time()
        self._push_timer = loop.call_later(
            next_push_at(now, self._pushed_at, self.load_push_seconds) - now, self._push_load)

    def _push_load(self) -> None:
        self._push_timer = None
        self._pushed_at = asyncio.get_running_loop().time()
        queued = self._queued.take(self.prefilling)
        self._announced.update(q.request_id for q in queued)
        withdrawn = tuple(self._withdrawn[:QUEUED_PROMPTS])
        del self._withdrawn[:QUEUED_PROMPTS]
        self._pushes.append(KvEventBatchData(-1, 0.0, load_only=True, queued=queued,
                                             withdrawn=withdrawn))
        self.load_pushes += 1
        self._wake()
        if self._withdrawn:
            self._schedule_push()

    def _flush_window(self, due: float) -> None:
        self._timer = None
        self._flush(due)

    def _flush(self, opened_at: float) -> KvEventBatchData:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        stored, removed = net_events(self._events)
        batch = KvEventBatchData(
            self.next_sequence_number, self._timestamp, stored, removed, self._cleared,
            self._load
        )
        self._events = []
        self._cleared = False
        self._load = None
        self._published_at = opened_at
        self.next_sequence_number += 1
        self._keep(batch)
        self._wake()
        return batch

    def _keep(self, batch: KvEventBatchData) -> None:
        history = self.history
        if len(history) == history.maxlen:
            self.held_events -= _size(history[0])  # append drops it
        history.append(batch)
        self.held_events += _size(batch)
        while self.held_events > self.max_events and len(history) > 1:
            self.held_events -= _size(history.popleft())

    def _wake(self) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def close(self) -> None:
        """Publish what is pending, then end every follower (engine stop)."""
        if self._timer is not None:
            self._flush(self._timestamp)
        if self._push_timer is not None:
            self._push_timer.cancel()
            self._push_timer = None
        self._closed = True
        self._wake()

    async def follow(self, start_sequence_number: int = 0) -> AsyncIterator[KvEventBatchData]:
        """Batches from `start_sequence_number`, then live ones, with each load push made
        while following (a load-only item; the last `PUSH_HISTORY` of those missed)."""
        nxt = start_sequence_number
        pushes = self.load_pushes
        self.followers += 1
        try:
            while True:
                history = self.history
                if history:
                    oldest = history[0].sequence_number
                    nxt = max(nxt, oldest)
                    while nxt < self.next_sequence_number:
                        # Recomputed each time: the deque may have moved while suspended.
                        oldest = history[0].sequence_number
                        nxt = max(nxt, oldest)
                        yield history[nxt - oldest]
                        nxt += 1
                if self._closed:
                    return
                if pushes != self.load_pushes:
                    missed, pushes = self.load_pushes - pushes, self.load_pushes
                    for push in list(self._pushes)[-missed:]:
                        yield push
                    continue
                if self._waiter is None:
                    self._waiter = asyncio.get_running_loop().create_future()
                await asyncio.shield(self._waiter)
        finally:
            self.followers -= 1


def _size(batch: KvEventBatchData) -> int:
    return len(batch.stored) + len(batch.removed)
