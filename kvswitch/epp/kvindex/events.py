"""KV events as the index consumes them: small frozen records, and the protobuf conversion.

The engine API streams `smg.grpc.common.KvEventBatch` messages. The index never
sees protobuf: `batch_from_proto` turns one message, read through `KvEventBatchView`, into an
`EventBatch` whose `events` keep the engine's order (a batch may remove a block and store it
again).

Decoding runs on the EPP's event loop for every block every engine stores, so a stored block
is decoded into a plain `(engine_hash, packed token ids)` pair (a `StoredBlock` is the same
tuple with names, for callers that build events by hand): the view hands over each block's ids
as their packed payload, one bytes object (`kvswitch.protocol.packed`), and no per-block object
is built beyond the pair.
A load-only batch may carry the prompts of requests the engine has just queued (kvswitch's
engine, to a subscriber that asked: `kvswitch.protocol.headers.QUEUED_PROMPTS`): stored events
marked `QUEUED_OWNERSHIP`, decoded into `EventBatch.queued` (`QueuedPrompt`), never into
`events`: their blocks are not stored yet; and the ids of requests so announced that left the
engine before their prefill ended (blockless, `WITHDRAWN_OWNERSHIP`): `EventBatch.withdrawn`.
The records built per batch are NamedTuples: immutable like a frozen dataclass, and about 3x
cheaper to build (a frozen dataclass sets each field through object.__setattr__).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvswitch.protocol import common_pb2
from kvswitch.protocol.headers import QUEUED_OWNERSHIP, WITHDRAWN_OWNERSHIP
from kvswitch.protocol.packed import KvEventBatchView, pack_token_ids

__all__ = [
    "BlocksRemoved", "BlocksStored", "CacheCleared", "EventBatch", "KvEvent", "KvEventBatchView",
    "LoadRecord", "QueuedPrompt", "SnapshotInfo", "StoredBlock", "batch_from_proto",
    "load_from_proto",
]

# Tiers/localities a per-worker prefix index holds: blocks on the device of this worker.
_DEVICE_TIERS = (common_pb2.KV_CACHE_TIER_UNSPECIFIED, common_pb2.KV_CACHE_TIER_DEVICE)


class StoredBlock(NamedTuple):
    engine_hash: int
    """The engine's block hash (only used to apply later removals)."""
    packed_token_ids: bytes
    """The block's token ids as protobuf packs them; the index folds them into its own chained
    hash."""

    @classmethod
    def of(cls, engine_hash: int, token_ids: Iterable[int]) -> StoredBlock:
        return cls(engine_hash, pack_token_ids(token_ids))


class BlocksStored(NamedTuple):
    """A chain of full blocks: `blocks[0]`'s parent is `parent_engine_hash`, then each the next."""

    blocks: tuple[tuple[int, bytes], ...]
    """(engine hash, packed token ids) per block: `StoredBlock`s or plain pairs."""
    parent_engine_hash: int | None
    """None: the chain starts at the root (the request's first block)."""
    block_size: int
    """The engine's block size as the event states it (0: not stated)."""
    namespace: tuple[str, str] = ("", "")
    """(lora_name, cache_salt): different namespaces never share blocks."""


class BlocksRemoved(NamedTuple):
    engine_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """AllBlocksCleared: the engine dropped every cached block."""


KvEvent = BlocksStored | BlocksRemoved | CacheCleared


class QueuedPrompt(NamedTuple):
    """A request the engine queued: its prompt's full blocks will be stored there."""

    request_id: str
    blocks: tuple[bytes, ...]
    """Packed token ids per full block, from the prompt's first."""


class LoadRecord(NamedTuple):
    """`EngineLoad`: the engine's load at one scheduler step (push-based telemetry)."""

    running: int
    waiting: int
    waiting_uncached_tokens: int | None
    """Prompt tokens of waiting requests not served from cache; None when not known."""
    token_usage: float
    """KV-cache utilisation in [0, 1]."""
    gen_throughput: float
    max_running: int
    sample: int
    """Monotonic per stream."""
    cache_hit_rate: float | None = None
    timestamp: float = 0.0
    """Wall-clock seconds the engine sampled it (its batch's timestamp); 0 when not stated."""


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """Set when the batch is one chunk of a relay's state snapshot."""

    index: int
    count: int
    unknown_before: int


class EventBatch(NamedTuple):
    sequence_number: int
    events: tuple[KvEvent, ...] = ()
    load: LoadRecord | None = None
    load_only: bool = False
    """A load record with no events; its sequence number only repeats the last one sent."""
    snapshot: SnapshotInfo | None = None
    queued: tuple[QueuedPrompt, ...] = ()
    """On a load-only batch: prompts the engine queued since its previous push."""
    withdrawn: tuple[str, ...] = ()
    """On a load-only batch: ids of announced requests that left before their prefill ended."""


def load_from_proto(load: Any, timestamp: float = 0.0) -> LoadRecord:
    # Positional arguments: bound faster than keywords.
    return LoadRecord(
        load.running_requests,
        load.waiting_requests,
        load.waiting_uncached_tokens if load.HasField("waiting_uncached_tokens") else None,
        load.token_usage,
        load.gen_throughput,
        load.max_running_requests,
        load.sample,
        load.cache_hit_rate if load.HasField("cache_hit_rate") else None,
        timestamp,
    )


def _stored_from_proto(stored: Any) -> BlocksStored | None:
    # Unset optional fields read as 0 (UNSPECIFIED tier, local, group 0): the value alone says
    # whether to keep the event, no HasField call needed.
    if (stored.tier not in _DEVICE_TIERS or stored.group_idx
            or stored.locality == common_pb2.KV_CACHE_LOCALITY_REMOTE):
        return None
    proto_blocks = stored.blocks
    blocks = tuple([(b.block_hash, b.token_ids) for b in proto_blocks])
    block_size = proto_blocks[0].block_size if proto_blocks else 0
    parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
    return BlocksStored(blocks, parent, block_size, (stored.lora_name, stored.cache_salt))


def batch_from_proto(message: Any) -> EventBatch:
    """Convert one `KvEventBatchView` (events of other tiers/groups are dropped)."""
    events: list[KvEvent] = []
    queued: list[QueuedPrompt] = []
    withdrawn: list[str] = []
    load = None
    load_only = False
    if message.HasField("load"):
        proto_load = message.load
        load = load_from_proto(proto_load, message.timestamp)
        load_only = proto_load.load_only
    for event in message.events:
        kind = event.WhichOneof("data")
        if kind == "stored":
            proto_stored = event.stored
            if load_only and proto_stored.ownership == QUEUED_OWNERSHIP:
                queued.append(QueuedPrompt(proto_stored.session_id,
                                           tuple([b.token_ids for b in proto_stored.blocks])))
                continue
            if load_only and proto_stored.ownership == WITHDRAWN_OWNERSHIP:
                withdrawn.append(proto_stored.session_id)
                continue
            stored = _stored_from_proto(proto_stored)
            if stored is not None:
                events.append(stored)
        elif kind == "removed":
            removed = event.removed
            if removed.tier in _DEVICE_TIERS and not removed.group_idx:
                events.append(BlocksRemoved(tuple(removed.block_hashes[:])))
        elif kind == "cleared":
            events.append(CacheCleared())
    snapshot = None
    if message.HasField("snapshot"):
        s = message.snapshot
        snapshot = SnapshotInfo(s.index, s.count, s.unknown_before)
    # positional: see load_from_proto
    return EventBatch(message.sequence_number, tuple(events), load, load_only, snapshot,
                      tuple(queued), tuple(withdrawn))
