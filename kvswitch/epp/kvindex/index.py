"""The precise prefix index: which full KV blocks each endpoint holds, fed by KV events.

Sans-IO. Per endpoint, a stored block's token ids are folded into kvswitch's own chained content
hash, so the index never depends on the engine's hash function (DESIGN §4):

    own(block i) = hash((own(block i-1), token_ids[i*B:(i+1)*B]))     own(block -1) = root(ns)

where `hash` is CPython's tuple hash (64-bit, xxHash-based; ints hash deterministically) and
`root(ns)` folds the (lora_name, cache_salt) namespace. The engine's hash is kept only as a key
(engine hash -> own hash) to apply `BlocksRemoved`. A block whose parent the index does not know
(it was stored before the subscription, or evicted) cannot be placed in a chain and is ignored.

Query: `match(block_hashes)` walks a request's own hashes once against one global table
own hash -> bitmask of endpoints holding it, so a query costs O(blocks) dict lookups however
many endpoints there are; an endpoint's match is its number of *leading* blocks held (the
engine's prefix-cache lookup also stops at its first miss).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvswitch.epp.kvindex.events import BlocksRemoved, BlocksStored, CacheCleared, KvEvent


def root_hash(namespace: tuple[str, str] = ("", "")) -> int:
    """The parent of a chain's first block. Strings hash per process: fine, the index is too."""
    return 0 if namespace == ("", "") else hash(("kvswitch-root", *namespace))


def block_hashes(token_ids: Sequence[int], block_size: int,
                 namespace: tuple[str, str] = ("", "")) -> list[int]:
    """Own chained hashes of every full block of `token_ids` (a trailing partial block: none)."""
    tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
    parent = root_hash(namespace)
    out: list[int] = []
    append = out.append
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tokens[start:start + block_size]))
        append(parent)
    return out


@dataclass(frozen=True, slots=True)
class ApplyStats:
    """What one `apply` did, for metrics and tests."""

    stored: int = 0
    """Blocks placed in the index."""
    unplaced: int = 0
    """Blocks whose parent chain was unknown (or whose size did not match) and were skipped."""
    removed: int = 0
    cleared: bool = False


class _Entry:
    """One engine hash: the own hash it maps to (None: unplaced) and its physical copies."""

    __slots__ = ("copies", "own")

    def __init__(self, own: int | None) -> None:
        self.own = own
        self.copies = 1


class _EndpointBlocks:
    """One endpoint's blocks: engine hash -> (own hash | None, copies), own hash -> copies."""

    __slots__ = ("bit", "by_engine", "own_copies")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.by_engine: dict[int, _Entry] = {}
        self.own_copies: dict[int, int] = {}


class PrefixIndex:
    """Blocks held per endpoint, by own chained hash. Not thread-safe; one event loop owns it."""

    def __init__(self, block_size: int = 16) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._endpoints: dict[str, _EndpointBlocks] = {}
        self._holders: dict[int, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0

    # -- endpoints -----------------------------------------------------------------------------

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._endpoints)

    def _state(self, endpoint: str) -> _EndpointBlocks:
        state = self._endpoints.get(endpoint)
        if state is None:
            bit = self._free_bits.pop() if self._free_bits else self._take_bit()
            state = self._endpoints[endpoint] = _EndpointBlocks(bit)
        return state

    def _take_bit(self) -> int:
        self._next_bit += 1
        return self._next_bit - 1

    def add_endpoint(self, endpoint: str) -> None:
        self._state(endpoint)

    def clear(self, endpoint: str) -> None:
        """Forget every block of `endpoint` (AllBlocksCleared, or a resync)."""
        state = self._endpoints.get(endpoint)
        if state is None:
            return
        mask = ~(1 << state.bit)
        holders = self._holders
        for own in state.own_copies:
            left = holders[own] & mask
            if left:
                holders[own] = left
            else:
                del holders[own]
        state.by_engine.clear()
        state.own_copies.clear()

    def remove_endpoint(self, endpoint: str) -> None:
        self.clear(endpoint)
        state = self._endpoints.pop(endpoint, None)
        if state is not None:
            self._free_bits.append(state.bit)

    def num_blocks(self, endpoint: str) -> int:
        """Distinct blocks (by content) the endpoint holds."""
        state = self._endpoints.get(endpoint)
        return 0 if state is None else len(state.own_copies)

    # -- events --------------------------------------------------------------------------------

    def apply(self, endpoint: str, events: Iterable[KvEvent]) -> ApplyStats:
        """Apply one batch's events, in order."""
        state = self._state(endpoint)
        stored = unplaced = removed = 0
        cleared = False
        for event in events:
            if isinstance(event, BlocksStored):
                placed, skipped = self._store(state, event)
                stored += placed
                unplaced += skipped
            elif isinstance(event, BlocksRemoved):
                removed += self._remove(state, event.engine_hashes)
            elif isinstance(event, CacheCleared):
                self.clear(endpoint)
                cleared = True
        return ApplyStats(stored, unplaced, removed, cleared)

    def _store(self, state: _EndpointBlocks, event: BlocksStored) -> tuple[int, int]:
        size = self.block_size
        parent: int | None
        if event.parent_engine_hash is None:
            parent = root_hash(event.namespace)
        else:
            entry = state.by_engine.get(event.parent_engine_hash)
            parent = None if entry is None else entry.own
        if event.block_size and event.block_size != size:
            parent = None  # another block size can never match our queries
        placed = 0
        bit = 1 << state.bit
        by_engine, own_copies, holders = state.by_engine, state.own_copies, self._holders
        for block in event.blocks:
            if parent is not None and len(block.token_ids) == size:
                parent = hash((parent, block.token_ids))
            else:
                parent = None
            entry = by_engine.get(block.engine_hash)
            if entry is not None:
                entry.copies += 1
                if entry.own is None and parent is not None:
                    entry.own = parent  # a later store taught us the chain: place it now
                    self._hold(own_copies, holders, parent, bit)
                    placed += 1
                continue
            by_engine[block.engine_hash] = _Entry(parent)
            if parent is not None:
                self._hold(own_copies, holders, parent, bit)
                placed += 1
        return placed, len(event.blocks) - placed

    @staticmethod
    def _hold(own_copies: dict[int, int], holders: dict[int, int], own: int, bit: int) -> None:
        count = own_copies.get(own, 0)
        own_copies[own] = count + 1
        if not count:
            holders[own] = holders.get(own, 0) | bit

    def _remove(self, state: _EndpointBlocks, engine_hashes: Iterable[int]) -> int:
        by_engine, own_copies, holders = state.by_engine, state.own_copies, self._holders
        mask = ~(1 << state.bit)
        removed = 0
        for engine_hash in engine_hashes:
            entry = by_engine.get(engine_hash)
            if entry is None:
                continue  # stored before we subscribed: nothing to undo
            entry.copies -= 1
            if entry.copies > 0:
                continue
            del by_engine[engine_hash]
            own = entry.own
            if own is None:
                continue
            removed += 1
            left = own_copies[own] - 1
            if left:
                own_copies[own] = left
                continue
            del own_copies[own]
            rest = holders[own] & mask
            if rest:
                holders[own] = rest
            else:
                del holders[own]
        return removed

    # -- queries -------------------------------------------------------------------------------

    def block_hashes(self, token_ids: Sequence[int],
                     namespace: tuple[str, str] = ("", "")) -> list[int]:
        return block_hashes(token_ids, self.block_size, namespace)

    def match(self, hashes: Sequence[int],
              endpoints: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of `hashes` each endpoint holds (every known or named endpoint)."""
        states = self._endpoints
        names = list(states) if endpoints is None else list(endpoints)
        bits = {states[n].bit: n for n in names if n in states}
        result = dict.fromkeys(names, 0)
        alive = 0
        for bit in bits:
            alive |= 1 << bit
        get = self._holders.get
        position = 0
        for position, own in enumerate(hashes):
            held = alive & get(own, 0)
            if held != alive:
                self._record(alive & ~held, bits, position, result)
                alive = held
                if not alive:
                    return result
        self._record(alive, bits, len(hashes), result)
        return result

    @staticmethod
    def _record(dropped: int, bits: Mapping[int, str], length: int,
                result: dict[str, int]) -> None:
        while dropped:
            low = dropped & -dropped
            result[bits[low.bit_length() - 1]] = length
            dropped ^= low

    def match_tokens(self, token_ids: Sequence[int],
                     endpoints: Iterable[str] | None = None) -> dict[str, int]:
        """Leading prompt tokens each endpoint holds in its cache (full blocks only)."""
        hashes = self.block_hashes(token_ids)
        return {e: n * self.block_size for e, n in self.match(hashes, endpoints).items()}
