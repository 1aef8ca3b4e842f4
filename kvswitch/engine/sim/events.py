"""KV event batches: numbering, a bounded history for replay, and live followers.

Every published batch gets the next sequence number (from 0). The log keeps the last
`capacity` batches; `follow(start)` replays those numbered >= start (from the oldest still held
if start is older), then yields new ones as they are published. All followers share one future
that the next `publish` resolves, so a batch costs O(1) regardless of the follower count.

Within a batch no block hash is both stored and removed: events are folded to their net effect
(the last event per hash wins), so a consumer may apply `removed` and `stored` in either order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence

from kvswitch.engine.base import EngineLoadSnapshot, KvBlockStored, KvEventBatchData

__all__ = ["KvEventLog", "net_events"]


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


class KvEventLog:
    def __init__(self, capacity: int = 4096) -> None:
        self.history: deque[KvEventBatchData] = deque(maxlen=max(1, capacity))
        self.next_sequence_number = 0
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    def publish(
        self,
        timestamp: float,
        events: Sequence[KvBlockStored | int] = (),
        *,
        cleared: bool = False,
        load: EngineLoadSnapshot | None = None,
    ) -> KvEventBatchData:
        stored, removed = net_events(events)
        batch = KvEventBatchData(
            self.next_sequence_number, timestamp, stored, removed, cleared, load
        )
        self.next_sequence_number += 1
        self.history.append(batch)
        self._wake()
        return batch

    def _wake(self) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def close(self) -> None:
        """End every follower (engine stop)."""
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
