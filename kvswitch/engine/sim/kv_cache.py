"""The paged KV cache, modelled on vLLM V1's BlockPool + KVCacheManager (sans-IO).

- The cache holds `num_gpu_blocks` blocks of `block_size` tokens.
- A FULL block gets a content hash chained on its parent's:
  `hash_i = hash((hash_{i-1}, tuple(token_ids of block i)))`, `hash_{-1} = ROOT_HASH`, so the same
  tokens after a different prefix hash differently and are never shared.
- Blocks are cached the moment they are allocated for full tokens (as vLLM V1 does: a request
  admitted later in the same step already hits them), and stay cached after their last user
  frees them, until reused.
- Free blocks wait in one LRU queue; allocation pops the front, evicting the cached content
  (a "removed" event). A finished request frees its blocks tail first, so its last blocks are
  evicted before its shared prefix.
- Events (stored / removed / cleared) accumulate until the engine drains them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvswitch.engine.base import KvBlockStored

if TYPE_CHECKING:
    from kvswitch.engine.sim.request import SimSequence

__all__ = ["ROOT_HASH", "BlockPool", "KvCacheManager", "block_hash"]

# The parent hash of a sequence's first block (vLLM's NONE_HASH), fixed so hashes are stable
# across runs and engines (Python does not randomise the hash of ints and tuples).
ROOT_HASH = 0x6B76_7377_6974_6368


def block_hash(parent: int, token_ids: tuple[int, ...]) -> int:
    """The chained content hash of a full block (a signed 64-bit int)."""
    return hash((parent, token_ids))


class BlockPool:
    """Block refcounts, the LRU free queue, the hash -> block map and the event log."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        # Insertion order is eviction order: the front is the least recently freed.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}
        # In order: a KvBlockStored, or an int = the hash of a removed block.
        self.events: list[KvBlockStored | int] = []
        self.cleared = False

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def lookup(self, h: int) -> int | None:
        return self.cached.get(h)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones off the queue."""
        ref, free = self.ref_cnt, self.free
        for b in block_ids:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Pop `n` blocks off the LRU front, evicting whatever they cached."""
        out = []
        popitem, ref, hashes = self.free.popitem, self.ref_cnt, self.block_hashes
        for _ in range(n):
            b = popitem(last=False)[0]
            h = hashes[b]
            if h is not None:
                hashes[b] = None
                # A duplicate (same content computed twice) is not the mapped copy: no event.
                if self.cached.get(h) == b:
                    del self.cached[h]
                    self.events.append(h)
            ref[b] = 1
            out.append(b)
        return out

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the queue's tail."""
        ref, free = self.ref_cnt, self.free
        for b in block_ids:
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def cache(self, b: int, h: int, parent: int | None, token_ids: tuple[int, ...]) -> None:
        """Record that block `b` now holds the full block with hash `h`."""
        self.block_hashes[b] = h
        if h not in self.cached:
            self.cached[h] = b
            self.events.append(KvBlockStored(h, parent, token_ids))

    def reset(self) -> bool:
        """Forget every cached block (AllBlocksCleared); refused while any block is in use."""
        if self.num_used:
            return False
        self.cached.clear()
        self.block_hashes = [None] * self.num_blocks
        self.events.clear()
        self.cleared = True
        return True

    def drain_events(self) -> tuple[list[KvBlockStored | int], bool]:
        """The events since the last drain, and whether the cache was cleared in between."""
        out = (self.events, self.cleared)
        self.events, self.cleared = [], False
        return out


class KvCacheManager:
    """Per-sequence block tables over a `BlockPool` (vLLM's KVCacheManager)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size

    def hash_full_blocks(self, seq: SimSequence) -> None:
        """Extend `seq.block_hashes` over every full block of its tokens (amortised O(1))."""
        bs, tokens, hashes = self.block_size, seq.token_ids, seq.block_hashes
        n = len(hashes)
        while (n + 1) * bs <= len(tokens):
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(block_hash(parent, tuple(tokens[n * bs : (n + 1) * bs])))
            n += 1

    def find_cached_prefix(self, seq: SimSequence) -> list[int]:
        """Blocks of the longest cached prefix. At least one token is always left to compute
        (vLLM recomputes the last prompt token to get logits), so a full hit stops a block short."""
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        out: list[int] = []
        lookup = self.pool.cached.get
        for h in seq.block_hashes[:max_blocks]:
            b = lookup(h)
            if b is None:
                break
            out.append(b)
        return out

    def count_cached_tokens(self, seq: SimSequence) -> int:
        return len(self.find_cached_prefix(seq)) * self.block_size

    def allocate_slots(
        self, seq: SimSequence, num_new_tokens: int, computed: Sequence[int] = ()
    ) -> bool:
        """Give `seq` the blocks for `num_new_tokens` more tokens after its computed ones (plus
        `computed` prefix-hit blocks for a newly admitted sequence); False if they do not fit.

        needed = ceil((computed_tokens + new) / block_size) - blocks held - hit blocks
        """
        bs, pool = self.block_size, self.pool
        num_computed = seq.num_computed_tokens + len(computed) * bs
        total = num_computed + num_new_tokens
        needed = -(-total // bs) - len(seq.blocks) - len(computed)
        if needed > 0 or computed:
            # Hit blocks that sit in the free queue stop being allocatable once touched.
            evictable_hits = sum(1 for b in computed if pool.ref_cnt[b] == 0)
            if needed > pool.num_free - evictable_hits:
                return False
            if computed:
                pool.touch(computed)
                seq.blocks.extend(computed)
                seq.num_cached_blocks = len(seq.blocks)
            if needed > 0:
                seq.blocks.extend(pool.allocate(needed))
        num_full = min(total, len(seq.token_ids)) // bs
        if num_full > seq.num_cached_blocks:
            self._cache_blocks(seq, num_full)
        return True

    def _cache_blocks(self, seq: SimSequence, num_full: int) -> None:
        bs, hashes, tokens = self.block_size, seq.block_hashes, seq.token_ids
        if len(hashes) < num_full:
            self.hash_full_blocks(seq)
        for i in range(seq.num_cached_blocks, num_full):
            parent = hashes[i - 1] if i else None
            self.pool.cache(seq.blocks[i], hashes[i], parent, tuple(tokens[i * bs : (i + 1) * bs]))
        seq.num_cached_blocks = num_full

    def free(self, seq: SimSequence) -> None:
        """Release the sequence's blocks, tail first (so the tail is evicted first)."""
        if seq.blocks:
            self.pool.release(reversed(seq.blocks))
            seq.blocks = []
        seq.num_cached_blocks = 0
