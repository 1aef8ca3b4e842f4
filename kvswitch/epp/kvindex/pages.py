"""SGLang's radix-cache pages -> the index's blocks, per endpoint (sans-IO).

An SGLang engine publishes its KV cache in pages of `page_size` tokens (`--page-size`, 1 by
default): each stored page names its parent page. The index hashes blocks of `B` tokens from the
root. `PageRegrouper` folds the page chains into `B`-token blocks so the index sees whole blocks
whatever the page size: per page it keeps the key of the last full block that ends at or before
the page's end (`None`: none yet, the root) and the page's tail, the tokens after that block
(fewer than `B`), so a chain continues from any page it knows, also one that branches in the
middle of a block. Block `j` completed inside page `p` is keyed `hash((p, j, "block"))`; its
parent is the previous block's key, so the index chains the blocks as it chains an engine's.

- A page whose parent page is unknown (stored before the subscription, or evicted) is dropped,
  as the index drops a block whose parent it does not know.
- BlocksRemoved of a page removes the blocks completed inside it: a radix cache evicts leaves
  first, so a block's later pages go no later than the page that completes it.
- CacheCleared forgets every page; `clear()` does the same on a resync.
- Events whose page size is `B` (or unstated) pass through untouched, and are not tracked.
Memory: one entry per page the engine holds (its KV capacity / page size), each with < B ids.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvswitch.epp.kvindex.events import BlocksRemoved, BlocksStored, CacheCleared, KvEvent
from kvswitch.protocol.packed import pack_token_ids, unpack_token_ids

__all__ = ["PageRegrouper"]

_Page = tuple[int | None, tuple[int, ...], tuple[int, ...]]
"""(key of the last full block ending at or before the page's end, tail ids after it,
keys of the blocks completed inside the page)."""


class PageRegrouper:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pages: dict[int, _Page] = {}

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

    def _store(self, event: BlocksStored) -> BlocksStored | None:
        size, pages = self.block_size, self._pages
        if event.parent_engine_hash is None:
            start: _Page = (None, (), ())
        else:
            known = pages.get(event.parent_engine_hash)
            if known is None:
                return None
            start = known
        first_parent, tail = start[0], start[1]
        last = first_parent
        blocks: list[tuple[int, bytes]] = []
        for page_hash, packed in event.blocks:
            ids = tail + unpack_token_ids(packed)
            done: list[int] = []
            while len(ids) >= size:
                key = hash((page_hash, len(done), "block"))
                blocks.append((key, pack_token_ids(ids[:size])))
                done.append(key)
                last, ids = key, ids[size:]
            tail = ids
            pages[page_hash] = (last, tail, tuple(done))
        if not blocks:
            return None
        return BlocksStored(tuple(blocks), first_parent, size, event.namespace)

    def _remove(self, page_hashes: Iterable[int]) -> tuple[int, ...]:
        removed: list[int] = []
        pop = self._pages.pop
        for page_hash in page_hashes:
            page = pop(page_hash, None)
            if page is not None:
                removed.extend(page[2])
        return tuple(removed)
