"""One `SubscribeKvEvents` stream: engine KV batches -> `smg.grpc.common.KvEventBatch`.

Each batch carries an `EngineLoad` record (push-based load telemetry). While the engine is quiet
the stream sends `load_only` heartbeats repeating the last sequence number sent, and with
`load_records_before_first_batch` it starts with a load-only batch numbered 0, as
`common.proto` specifies. A load push from the engine (`load_only` data: a request arrived and
several EPPs follow) goes out the same way, with the load of that moment, unless the routing
core of that load (running, waiting, uncached waiting tokens, KV usage) equals the last record
this stream sent: then the request has come and gone, or its load was offset, and the push would
tell no EPP anything it does not already see (a short request at a high rate would otherwise cost
every EPP a record per push). Stored blocks are grouped into one `KvBlocksStored` event per
chain (each block's parent is the previous block), vLLM's BlockStored shape.

Queued prompts (kvswitch's extension, for subscribers that ask with the call's metadata
`x-kvswitch-queued-prompts: 1`; several EPPs do): a load push also carries the prompts of the
requests that arrived since the previous one and whose prefill has not ended, each as one
`KvBlocksStored` event with
`ownership` `kvswitch-queued`, `session_id` the request id and no parent, its blocks the
prompt's full blocks from the first (no engine hash yet: 0). The blocks are not stored yet.
A request so announced that leaves before its prefill ends is withdrawn on a later push: a
`KvBlocksStored` with `ownership` `kvswitch-withdrawn`, `session_id` its id and no blocks.
A push with either goes out even when its load repeats the last record. Other subscribers never
see them (`common.proto`: a load-only batch carries no events).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

from kvswitch.engine.base import Engine, EngineLoadSnapshot, KvEventBatchData, QueuedPrompt
from kvswitch.protocol import common_pb2
from kvswitch.protocol.headers import QUEUED_OWNERSHIP, WITHDRAWN_OWNERSHIP

HEARTBEAT_SECONDS = 1.0
_QUEUE_LIMIT = 4096
_END = object()


def to_int64(block_hash: int) -> int:
    """The proto's hashes are int64: wrap an unsigned 64-bit engine hash into that range."""
    block_hash &= (1 << 64) - 1
    return block_hash - (1 << 64) if block_hash >= 1 << 63 else block_hash


def load_record(load: EngineLoadSnapshot, sample: int, *, load_only: bool, full: bool
                ) -> common_pb2.EngineLoad:
    record = common_pb2.EngineLoad(
        running_requests=load.running,
        waiting_requests=load.waiting,
        waiting_uncached_tokens=load.waiting_uncached_tokens,
        token_usage=load.token_usage,
        gen_throughput=load.gen_throughput,
        max_running_requests=load.max_running,
        age_ms=0,
        sample=sample,
        load_only=load_only,
    )
    if full:
        # Telemetry beyond the routing core goes on the heartbeat cadence only (common.proto).
        record.cache_hit_rate = load.cache_hit_rate
        record.num_used_tokens = load.used_tokens
        record.max_total_num_tokens = load.total_tokens
    return record


def batch_events(data: KvEventBatchData, block_size: int, first_event_id: int
                 ) -> list[common_pb2.KvCacheEvent]:
    """Events in the order they take effect: a clear, evictions, then new blocks.

    Stored blocks become one `KvBlocksStored` per chain: a block whose parent ends a chain of
    this batch extends that chain's event, even when other requests' blocks came in between.
    A coalesced batch holds many steps, and decode fills a request's blocks one per step, so
    consecutive runs alone would send most decode blocks as one-block events, each costing the
    EPP an event to decode and apply (~2.4 us in process, more than its block). Parents still
    come first: a chain's event is created before any block that extends it, and a block whose
    parent sits inside a chain (not at its end) starts a new event after that chain's."""
    events: list[common_pb2.KvCacheEvent] = []
    if data.cleared:
        events.append(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))
    if data.removed:
        events.append(common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(
            block_hashes=[to_int64(h) for h in data.removed])))
    chain_ends: dict[int, common_pb2.KvBlocksStored] = {}
    """The last block hash of each chain so far -> that chain's event."""
    for block in data.stored:
        parent = block.parent_block_hash
        chain = chain_ends.pop(parent, None) if parent is not None else None
        if chain is None:
            event = common_pb2.KvCacheEvent(stored=common_pb2.KvBlocksStored())
            if parent is not None:
                event.stored.parent_block_hash = to_int64(parent)
            events.append(event)
            chain = event.stored
        chain.blocks.append(common_pb2.KvBlock(
            block_hash=to_int64(block.block_hash), token_ids=block.token_ids,
            block_size=block_size))
        chain_ends[block.block_hash] = chain
    for offset, event in enumerate(events):
        event.event_id = first_event_id + offset
    return events


def queued_events(prompts: Sequence[QueuedPrompt], block_size: int
                  ) -> list[common_pb2.KvCacheEvent]:
    """One `KvBlocksStored` per queued prompt, marked as queued (see the module docstring)."""
    events = []
    for prompt in prompts:
        tokens = prompt.token_ids
        blocks = [common_pb2.KvBlock(token_ids=tokens[i:i + block_size], block_size=block_size)
                  for i in range(0, len(tokens) - block_size + 1, block_size)]
        events.append(common_pb2.KvCacheEvent(stored=common_pb2.KvBlocksStored(
            blocks=blocks, ownership=QUEUED_OWNERSHIP, session_id=prompt.request_id)))
    return events


def withdrawn_events(request_ids: Sequence[str]) -> list[common_pb2.KvCacheEvent]:
    """One blockless `KvBlocksStored` per withdrawn request (see the module docstring)."""
    return [common_pb2.KvCacheEvent(stored=common_pb2.KvBlocksStored(
        ownership=WITHDRAWN_OWNERSHIP, session_id=request_id)) for request_id in request_ids]


class KvEventStream:
    def __init__(self, engine: Engine, start_sequence_number: int, *, load_first: bool,
                 queued_prompts: bool = False):
        self.engine = engine
        self.start = start_sequence_number
        self.load_first = load_first
        self.queued_prompts = queued_prompts
        """The subscriber asked for the prompts of queued requests on load pushes."""
        self.block_size = engine.model.block_size
        self._sample = 0
        self._next_event_id = 1
        self._last_sequence: int | None = 0 if load_first else None
        self._last_core: tuple[int, int, int, float] | None = None
        """The routing core of the last load record sent."""

    async def run(self, stop: asyncio.Event) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Batches until `stop` is set (server draining) or the engine's stream ends."""
        queue: asyncio.Queue[object] = asyncio.Queue(_QUEUE_LIMIT)
        pump = asyncio.create_task(self._pump(queue))
        stopper = asyncio.create_task(self._end_on(stop, queue))
        try:
            if self.load_first:
                yield self._load_only()
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), HEARTBEAT_SECONDS)
                except TimeoutError:
                    if self._last_sequence is not None:
                        yield self._load_only()
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, KvEventBatchData)
                if not item.load_only:
                    yield self._batch(item)
                elif self._last_sequence is not None:  # nothing to repeat before a batch
                    load = self.engine.load()
                    queued = item.queued if self.queued_prompts else ()
                    withdrawn = item.withdrawn if self.queued_prompts else ()
                    if queued or withdrawn or load.routing_core != self._last_core:
                        yield self._load_only(full=False, load=load, queued=queued,
                                              withdrawn=withdrawn)
        finally:
            for task in (pump, stopper):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _pump(self, queue: asyncio.Queue[object]) -> None:
        events = self.engine.kv_events(self.start)
        try:
            async for data in events:
                await queue.put(data)
            await queue.put(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the RPC, which reports INTERNAL
            await queue.put(exc)
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    @staticmethod
    async def _end_on(stop: asyncio.Event, queue: asyncio.Queue[object]) -> None:
        await stop.wait()
        await queue.put(_END)

    def _batch(self, data: KvEventBatchData) -> common_pb2.KvEventBatch:
        events = batch_events(data, self.block_size, self._next_event_id)
        self._next_event_id += len(events)
        self._sample += 1
        first_record = self._last_sequence is None
        self._last_sequence = data.sequence_number
        load = data.load if data.load is not None else self.engine.load()
        self._last_core = load.routing_core
        return common_pb2.KvEventBatch(
            sequence_number=data.sequence_number, timestamp=data.timestamp, events=events,
            dp_rank=0, load=load_record(load, self._sample, load_only=False, full=first_record))

    def _load_only(self, *, full: bool = True, load: EngineLoadSnapshot | None = None,
                   queued: Sequence[QueuedPrompt] = (),
                   withdrawn: Sequence[str] = ()) -> common_pb2.KvEventBatch:
        self._sample += 1
        if load is None:
            load = self.engine.load()
        self._last_core = load.routing_core
        events = (queued_events(queued, self.block_size) if queued else []) + (
            withdrawn_events(withdrawn) if withdrawn else [])
        return common_pb2.KvEventBatch(
            sequence_number=self._last_sequence or 0, timestamp=time.time(), dp_rank=0,
            events=events or None,
            load=load_record(load, self._sample, load_only=True, full=full))
