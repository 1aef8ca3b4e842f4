"""SGLang's radix-cache pages -> the index's blocks, per endpoint (sans-IO).

An SGLang engine publishes its KV cache in pages of `page_size` tokens (`--page-size`, 1 by
default): each stored chain of pages names its parent page. The index hashes blocks of `B`
tokens from the root. `PageRegrouper` folds page chains into `B`-token blocks so the index sees
whole blocks whatever the page size.

A stored event becomes a `_Chain`: the packed ids of its pages joined behind the tail its parent
page left (the ids after the parent's last whole block, fewer than `B`), cut into whole blocks
with the index's varint pattern. Block `j` of a chain is keyed `hash((first page, j, "block"))`
and chained to the block before it (the first to the parent's last whole block, or the root),
so the index places them as it places an engine's blocks. Each page is recorded only as
(chain, position); the state a later chain continues from (last whole block, tail) is worked
out when a page turns out to be a parent, also one in the middle of a block (a branch).

- A chain whose parent page is unknown (stored before the subscription, or evicted) is dropped,
  as the index drops a block whose parent it does not know; so is one whose pages do not hold
  `page_size` ids each.
- BlocksRemoved of a page removes the blocks completed inside it: a radix cache evicts leaves
  first, so a block's later pages go no later than the page that completes it.
- CacheCleared forgets every page; `clear()` does the same on a resync.
- Events whose page size is `B` (or unstated) pass through untouched, and are not tracked.
- A queued prompt a load push announces comes in the engine's blocks, whatever its page size:
  `whole_blocks` cuts its ids into `B`-token blocks (a partial last block: dropped).
Ids stay in their packed wire form (`kvswitch.protocol.packed`), never built into ints; the work
per page is one dict entry. Memory: one entry per page the engine holds, plus its chain's ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat

from kvswitch.epp.kvindex.events import BlocksRemoved, BlocksStored, CacheCleared, KvEvent
from kvswitch.epp.kvindex.hashing import block_pattern
from kvswitch.protocol.packed import count_token_ids

__all__ = ["PageRegrouper", "whole_blocks"]


class _Chain:
    """One stored chain of pages, cut into whole blocks."""

    __slots__ = ("ends", "keys", "page_size", "parent_key", "start_count", "stream")

    def __init__(self, parent_key: int | None, start_count: int, page_size: int, stream: bytes,
                 keys: list[int], ends: list[int]) -> None:
        self.parent_key = parent_key
        """The key of the last whole block before the chain (None: the root)."""
        self.start_count = start_count
        """Ids of the parent's tail at the head of `stream`."""
        self.page_size = page_size
        self.stream = stream
        """The parent's tail, then every page's ids, packed."""
        self.keys = keys
        self.ends = ends
        """Byte offset in `stream` where each block ends."""


class PageRegrouper:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pages: dict[int, tuple[_Chain, int]] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def clear(self) -> None:
        self._pages.clear()

    def regroup(self, events: Iterable[KvEvent]) -> list[KvEvent]:
        """The events as the index should apply them, in order."""
        out: list[KvEvent] = []
        for event in events:
            if isinstance(event, BlocksStored):
                if event.block_size in (0, self.block_size):
                    out.append(event)
                else:
                    stored = self._store(event)
                    if stored is not None:
                        out.append(stored)
            elif isinstance(event, BlocksRemoved):
                removed = self._remove(event.engine_hashes)
                if removed:
                    out.append(BlocksRemoved(removed))
            else:
                if isinstance(event, CacheCleared):
                    self._pages.clear()
                out.append(event)
        return out

    def _after(self, page_hash: int) -> tuple[int | None, bytes, int] | None:
        """What follows a known page: (last whole block's key, the ids after it, their count)."""
        where = self._pages.get(page_hash)
        if where is None:
            return None
        chain, position = where
        size = self.block_size
        count = chain.start_count + (position + 1) * chain.page_size
        blocks, rest = divmod(count, size)
        key = chain.keys[blocks - 1] if blocks else chain.parent_key
        begin = chain.ends[blocks - 1] if blocks else 0
        if not rest:
            return key, b"", 0
        match = block_pattern(rest).match(chain.stream, begin)
        return key, chain.stream[begin:match.end()] if match else b"", rest

    def _store(self, event: BlocksStored) -> BlocksStored | None:
        pages = event.blocks
        if not pages:
            return None
        parent = event.parent_engine_hash
        start = (None, b"", 0) if parent is None else self._after(parent)
        if start is None:
            return None
        parent_key, tail, start_count = start
        page_size = event.block_size
        stream = tail + b"".join([packed for _, packed in pages])
        total = start_count + len(pages) * page_size
        if count_token_ids(stream) != total:
            return None  # pages of another size than stated: cannot be placed
        size, first = self.block_size, pages[0][0]
        cut = block_pattern(size).match
        keys: list[int] = []
        ends: list[int] = []
        blocks: list[tuple[int, bytes]] = []
        begin = 0
        for j in range(total // size):
            end = cut(stream, begin).end()  # type: ignore[union-attr]  # counted above
            key = hash((first, j, "block"))
            keys.append(key)
            ends.append(end)
            blocks.append((key, stream[begin:end]))
            begin = end
        chain = _Chain(parent_key, start_count, page_size, stream, keys, ends)
        # Every page as (chain, position), in one C-level update.
        self._pages.update(zip([page_hash for page_hash, _ in pages],
                               zip(repeat(chain), range(len(pages)))))
        if not blocks:
            return None
        return BlocksStored(tuple(blocks), parent_key, size, event.namespace)

    def _remove(self, page_hashes: Iterable[int]) -> tuple[int, ...]:
        removed: list[int] = []
        pop, size = self._pages.pop, self.block_size
        for page_hash in page_hashes:
            where = pop(page_hash, None)
            if where is None:
                continue
            chain, position = where
            # Block j completes inside this page when (j + 1) * size falls in (before, after].
            before = chain.start_count + position * chain.page_size
            removed.extend(chain.keys[before // size:(before + chain.page_size) // size])
        return tuple(removed)


def whole_blocks(packed: Sequence[bytes], block_size: int) -> tuple[bytes, ...]:
    """The ids of `packed` (packed payloads, in order) as whole blocks of `block_size`."""
    return tuple(block_pattern(block_size).findall(b"".join(packed)))
