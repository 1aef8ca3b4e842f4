"""Precise prefix-cache index for the EPP, fed by the engines' KV events.

- `chained_block_hashes` (`hashing.py`): kvswitch's own chained content hash of a prompt's blocks.
- `KvBlockIndex` (sans-IO): per endpoint, the full blocks it holds under that hash;
  `match(hashes)` gives each endpoint's leading matched blocks.
- `SequenceTracker` (sans-IO): sequence numbers of one stream -> apply / skip / resync verdicts.
- `KvEventSubscriber` / `KvEventSubscriptions`: thin asyncio loops (over
  `kvswitch.protocol.h2client`) that feed the index and keep each engine's pushed `EngineLoad`
  record.

The `precise-prefix-cache-scorer` plugin that reads this index is `epp/plugins/`'s.
"""

from __future__ import annotations

from kvswitch.epp.kvindex.events import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    EventBatch,
    KvEvent,
    KvEventBatchView,
    LoadRecord,
    SnapshotInfo,
    StoredBlock,
    batch_from_proto,
)
from kvswitch.epp.kvindex.hashing import chained_block_hashes, root_hash
from kvswitch.epp.kvindex.index import ApplyStats, KvBlockIndex
from kvswitch.epp.kvindex.stream import SequenceTracker, Verdict
from kvswitch.epp.kvindex.subscriber import KvEventSubscriber, KvEventSubscriptions

__all__ = [
    "ApplyStats", "BlocksRemoved", "BlocksStored", "CacheCleared", "EventBatch", "KvBlockIndex",
    "KvEvent", "KvEventBatchView", "KvEventSubscriber", "KvEventSubscriptions", "LoadRecord",
    "SequenceTracker", "SnapshotInfo", "StoredBlock", "Verdict", "batch_from_proto",
    "chained_block_hashes", "root_hash",
]
