"""KV event batches: numbering, a bounded history for replay, and live followers.

Every published batch gets the next sequence number (from 0). The log keeps the last
`capacity` batches holding at most `max_events` block events (stored + removed) between them,
the newest batch always; `follow(start)` replays those numbered >= start (from the oldest still
held if start is older), then yields new ones as they are published. All followers share one
future that the next `publish` resolves, so a batch costs O(1) regardless of the follower count.

Why both bounds: batches are coalesced per 50 ms window, so under load one batch holds hundreds
of events, each stored block with its token ids (~0.7 kB in Python). 4,096 batches alone let an
engine's replay history grow to ~1 GB (measured at --time-scale 10000: RSS rose ~6 kB per request
for minutes); the event bound keeps it near 45 MB. A follower that falls further behind sees a
gap in the numbering and resyncs, as it would after any lost batch (vLLM's replay buffer is
bounded too, by steps).

Within a batch no block hash is both stored and removed: events are folded to their net effect
(the last event per hash wins), so a consumer may apply `removed` and `stored` in either order.

Coalescing (`coalesce_seconds`, default 50 ms; 0 publishes every call): the engine publishes
once per scheduler step (~10-30 ms), and every batch costs each subscriber (the EPP) a message
to decode and apply. A call made at least `coalesce_seconds` (by its timestamp) after the
previous batch is published at once (a quiet engine's news are not delayed); later calls inside
that window are merged, in order, into one pending batch that a timer publishes when the window
ends, with the latest load. A clear is published at once all the same (it drops the pending
events it supersedes). Numbering stays contiguous (a merged batch takes one number), so replay
is unchanged. So a subscriber gets at most one batch per window from each engine, however the
engine's load moves.

Load moves inside a window wait for it, like block events: the load the EPP scores with is then
at most 50 ms old, which is what upstream's EPP gets from its default 50 ms metrics refresh, and
the EPP's speculative index entries cover the requests it routed meanwhile. Two earlier rules
published sooner and bought no routing quality:
- every large load move at once (running or waiting moved by max(2, a quarter), or KV usage by
  5%): about one batch per request under load (~115/s per engine at 125 req/s), ~0.03-0.06 ms
  EPP CPU per streamed request in the gateway benchmark (three alternating runs each:
  0.384-0.452 against 0.355-0.362 ms); on the 8-replica 150x5 shared-prefix ladder
  (docs/benchmarks/, 6 -> 30 QPS) TTFT p90, output tok/s and cache hit stayed within 3% of the
  published run at every step without it;
- an engine that went idle (nothing running or waiting) at once: an engine with a few requests
  in flight empties between them, so under the gateway benchmark's load it still sent ~57
  batches/s instead of 20, and the EPP used ~6% more CPU per streamed request (three
  alternating runs each: 0.224-0.231 against 0.201-0.216 ms). Without it the ladder's TTFT p90,
  output tok/s and cache hit stayed within 2% of the published run at every step
  (benchmarks/results/ladder_kv_no_idle_flush.json).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Sequence

from kvswitch.engine.base import EngineLoadSnapshot, KvBlockStored, KvEventBatchData

__all__ = ["COALESCE_SECONDS", "MAX_EVENTS", "KvEventLog", "net_events"]

COALESCE_SECONDS = 0.05


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
                 max_events: int = MAX_EVENTS) -> None:
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
        self._closed = True
        self._wake()

    async def follow(self, start_sequence_number: int = 0) -> AsyncIterator[KvEventBatchData]:
        nxt = start_sequence_number
        while True:
            history = self.history
            if history:
                oldest = history[0].sequence_number
                nxt = max(nxt, oldest)
                while nxt < self.next_sequence_number:
                    # Recomputed each time: the deque may have moved while we were suspended.
                    oldest = history[0].sequence_number
                    nxt = max(nxt, oldest)
                    yield history[nxt - oldest]
                    nxt += 1
            if self._closed:
                return
            if self._waiter is None:
                self._waiter = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._waiter)


def _size(batch: KvEventBatchData) -> int:
    return len(batch.stored) + len(batch.removed)
