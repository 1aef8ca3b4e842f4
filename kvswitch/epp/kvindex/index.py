"""The precise prefix index: which full KV blocks each endpoint holds, fed by KV events.

Sans-IO. Per endpoint, a stored block's token ids are folded into kvswitch's own chained content
hash (`kvswitch.epp.kvindex.hashing`), so the index never depends on the engine's hash function.
The engine's hash is kept only as a key (engine hash -> own hash) to apply `BlocksRemoved`. A
block whose parent the index does not know (it was stored before the subscription, or
evicted) cannot be placed in a chain and is ignored.

Query: `match(block_hashes)` walks a request's own hashes once against one global table
own hash -> bitmask of endpoints holding it, so a query costs O(blocks) dict lookups however
many endpoints there are; an endpoint's match is its number of *leading* blocks held (the
engine's prefix-cache lookup also stops at its first miss). `match_held` leaves out the zeros
(the scorer's per-request form).

Speculative entries (llm-d's speculative indexing) close the gap between a pick and the
engine's BlockStored events, which come only after the request's prefill step:
`speculate(endpoint, hashes, ttl)` marks the blocks of a request just routed to `endpoint` as
held there until `now + ttl` (the index's injected clock), so the next request with the same
prefix matches at once. Per endpoint a block is either real (reported stored) or speculative,
never both:
- a BlockStored that places the block confirms it (it becomes real, `ApplyStats.confirmed`);
- speculating a block that is already real is a no-op; speculating a speculative block again
  extends its expiry, except in the leading run the caller says is held (`held`): those keep
  the expiry of the request that will store them;
- unconfirmed by its expiry, it is dropped (lazily, at the next `match`/`speculate`);
- `withdraw(speculation)` drops a speculation's unconfirmed blocks at once (its request ended
  without a prefill: it failed, or was cancelled while queued), except those a later one claims;
- the blocks listed by live speculations are bounded (`max_speculated_blocks`): past it, the
  oldest speculations are dropped early, as at their expiry;
- AllBlocksCleared, a resync (`clear`) or the endpoint leaving drop it at once; BlockRemoved
  can only name real blocks (a speculative one has no engine hash yet).
Both kinds set the endpoint's bit in the one holder table, so `match` costs the same.
Cost per request: O(blocks not already held), a few dict operations each, and at expiry
O(blocks of the speculation) in C.

Prefill in progress: `await_prefill(endpoint, hashes, tokens, ttl, held)` counts a routed
prompt's uncached tokens in `pending_prefill(endpoint)` (and the request in
`prefilling_requests(endpoint)`) until the prompt's last full block is stored there (the engine
stores a block once the step computing it ends, and the step that computes a prompt's last
block ends its prefill), the request ends (`end_prefill`: its response may come before the
KV-event batch that stores the block), or `ttl` passes. A long prompt is prefilled in chunks,
one per step, and each chunk's blocks are stored as its step ends: every PROGRESS_BLOCKS-th
uncached block is a checkpoint, and once one is stored at most the tokens of the blocks after
it still count (so the count is what is left to prefill, to within PROGRESS_BLOCKS blocks).
`await_prefill` returns the request's `PrefillTicket`, which `end_prefill` takes: a request ends
once whichever comes first, and an end never reaches another request awaiting the same block
(the same prompt twice, or a later one after the block was stored). The engine's own load
report counts only waiting requests' prefill; this also covers requests admitted and still
prefilling (chunked prefill of a long prompt). Two dict tests per newly real block. An endpoint
whose events cannot be indexed (another block size, `set_indexed`) awaits nothing.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvswitch.epp.kvindex.events import BlocksRemoved, BlocksStored, CacheCleared, KvEvent
from kvswitch.epp.kvindex.hashing import chained_block_hashes, root_hash


class ApplyStats(NamedTuple):
    """What one `apply` did, for metrics and tests (a NamedTuple: built once per batch, ~3x
    cheaper than a frozen dataclass)."""

    stored: int = 0
    """Blocks placed in the index."""
    unplaced: int = 0
    """Blocks whose parent chain was unknown (or whose size did not match) and were skipped."""
    removed: int = 0
    cleared: bool = False
    confirmed: int = 0
    """Placed blocks that were speculative until now."""


class _EndpointBlocks:
    """One endpoint's blocks: engine hash -> own hash (None: unplaced), extra physical copies of
    an engine hash (rare; absent = one), extra placements of an own hash under other engine
    hashes (rare; absent = one), speculative own hash -> expiry, and how many own hashes it
    holds really. Plain dicts of ints: no object per block.

    Whether the endpoint holds an own hash lives in the shared holder table alone (its bit;
    speculative if the hash is in `speculative`, else real): no per-endpoint dict of own hashes
    is kept beside it: one dict less to touch at every speculate, store and remove, each a
    likely cache miss in a loaded EPP, whose tables are far larger than the CPU caches (4 x
    29k blocks: ~4 MB less), and no second copy of the same fact to keep in step."""

    __slots__ = ("awaiting", "bit", "by_engine", "checkpoints", "extra_copies", "extra_owns",
                 "indexed", "pending", "prefilling", "real", "speculative")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.by_engine: dict[int, int | None] = {}
        self.extra_copies: dict[int, int] = {}
        self.extra_owns: dict[int, int] = {}
        self.speculative: dict[int, float] = {}
        self.real = 0
        # Prefill in progress: a routed prompt's last block -> [its uncached tokens left,
        # requests, generation, the tokens as routed, its checkpoint blocks], until the block is
        # stored (the step that computes a prompt's last block ends its prefill); the
        # generation tells this entry from one before the block was stored, for the tickets of
        # that one.
        self.awaiting: dict[int, list[Any]] = {}
        # A checkpoint block of an awaited prompt -> (its last block, the entry's generation,
        # tokens per request after the checkpoint); dropped with the entry.
        self.checkpoints: dict[int, tuple[int, int, int]] = {}
        self.pending = 0
        self.prefilling = 0
        # False while the endpoint's events cannot be indexed (another block size): no
        # prefill is awaited there, as no BlockStored would end it.
        self.indexed = True


@dataclass(slots=True, eq=False)  # a ticket is one request's: compared by identity
class PrefillTicket:
    """One request's prefill counted by `KvBlockIndex.await_prefill`, until it ends."""

    until: float
    endpoint: str
    state: _EndpointBlocks
    last_hash: int
    tokens: int
    generation: int
    live: bool = True


def _drop_copy(counts: dict[int, int], key: int) -> None:
    """One extra copy of `key` fewer in `extra_copies` / `extra_owns` (absent = none extra)."""
    copies = counts[key]
    if copies > 1:
        counts[key] = copies - 1
    else:
        del counts[key]


def _progress(state: _EndpointBlocks, checkpoint: tuple[int, int, int]) -> None:
    """A checkpoint block of an awaited prompt is stored: at most the tokens after it are left
    per request."""
    last_hash, generation, after = checkpoint
    entry = state.awaiting.get(last_hash)
    if entry is None or entry[2] != generation:
        return
    left = min(entry[0], entry[1] * after)
    state.pending -= entry[0] - left
    entry[0] = left


def _drop_checkpoints(state: _EndpointBlocks, entry: list[Any]) -> None:
    """An awaited prompt's count ended: forget its checkpoints (not a later entry's)."""
    checkpoints, generation = state.checkpoints, entry[2]
    for mark in entry[4]:
        checkpoint = checkpoints.get(mark)
        if checkpoint is not None and checkpoint[1] == generation:
            del checkpoints[mark]


# One speculation: (expiry, tie-break, endpoint state, the blocks it made speculative).
Speculation = tuple[float, int, _EndpointBlocks, list[int]]
MAX_SPECULATED_BLOCKS = 1 << 21  # block hashes listed by live speculations (~80 MB at most)
PROGRESS_BLOCKS = 64  # an awaited prefill's progress is read every 64 blocks (1,024 tokens at 16)


class KvBlockIndex:
    """Blocks held per endpoint, by own chained hash. Not thread-safe; one event loop owns it."""

    def __init__(self, block_size: int = 16,
                 clock: Callable[[], float] = time.monotonic,
                 max_speculated_blocks: int | None = MAX_SPECULATED_BLOCKS) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.clock = clock
        """Seconds, monotonic; only speculative expiry reads it."""
        self.max_speculated_blocks = max_speculated_blocks
        """None: unbounded (the bench's model of a router that keeps every routed prompt)."""
        self._endpoints: dict[str, _EndpointBlocks] = {}
        self._holders: dict[int, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        # `match`'s bit tables per tuple of endpoint names; bits change only when an endpoint
        # joins or leaves, which empties it.
        self._tables: dict[tuple[str, ...], tuple[int, dict[int, str]]] = {}
        # (expiry, tie-break, endpoint state, hashes) per speculation, earliest expiry first. A
        # FIFO, not a heap: with one TTL, expiries arrive in order (a push and a pop touch only
        # the ends; a heap's sift walks entries scattered in memory).
        self._expiries: deque[Speculation] = deque()
        self._speculations = 0
        self._speculated_blocks = 0  # the blocks listed in `_expiries`
        # The ticket of every awaited prefill, expiry order.
        self._awaiting: deque[PrefillTicket] = deque()
        self._generations = itertools.count(1)
        self.pending: dict[str, int] = {}
        """endpoint -> `pending_prefill(endpoint)` (absent: 0), for per-endpoint reads."""
        self.prefilling: dict[str, int] = {}
        """endpoint -> requests counted in `pending` (absent: 0)."""

    # -- endpoints -----------------------------------------------------------------------------

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._endpoints)

    def _state(self, endpoint: str) -> _EndpointBlocks:
        state = self._endpoints.get(endpoint)
        if state is None:
            bit = self._free_bits.pop() if self._free_bits else self._take_bit()
            state = self._endpoints[endpoint] = _EndpointBlocks(bit)
            self._tables.clear()
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
        # Every real own hash is placed under at least one engine hash.
        real = {own for own in state.by_engine.values() if own is not None}
        self._release(real, state.bit)
        self._release(state.speculative, state.bit)
        state.by_engine.clear()
        state.extra_copies.clear()
        state.extra_owns.clear()
        state.speculative.clear()
        state.real = 0
        state.awaiting.clear()
        state.checkpoints.clear()
        state.pending = state.prefilling = 0
        self.pending.pop(endpoint, None)
        self.prefilling.pop(endpoint, None)

    def _release(self, owns: Iterable[int], bit: int) -> None:
        """The endpoint with `bit` no longer holds these blocks (real or speculative)."""
        holders, mask = self._holders, ~(1 << bit)
        for own in owns:
            left = holders[own] & mask
            if left:
                holders[own] = left
            else:
                del holders[own]

    def remove_endpoint(self, endpoint: str) -> None:
        self.clear(endpoint)
        state = self._endpoints.pop(endpoint, None)
        if state is not None:
            self._free_bits.append(state.bit)
            self._tables.clear()

    def num_blocks(self, endpoint: str) -> int:
        """Distinct blocks (by content) the endpoint reported stored (speculative: not)."""
        state = self._endpoints.get(endpoint)
        return 0 if state is None else state.real

    def holds_really(self, endpoint: str, own_hash: int) -> bool:
        """The endpoint reported this block stored (a speculative block: False)."""
        state = self._endpoints.get(endpoint)
        return (state is not None and bool(self._holders.get(own_hash, 0) >> state.bit & 1)
                and own_hash not in state.speculative)

    def num_speculative(self, endpoint: str) -> int:
        """Speculative blocks of the endpoint not yet confirmed (expired ones may linger until
        the next `match`/`speculate`)."""
        state = self._endpoints.get(endpoint)
        return 0 if state is None else len(state.speculative)

    # -- events --------------------------------------------------------------------------------

    def apply(self, endpoint: str, events: Iterable[KvEvent]) -> ApplyStats:
        """Apply one batch's events, in order."""
        state = self._state(endpoint)
        stored = unplaced = removed = 0
        cleared = False
        speculative = len(state.speculative)
        for event in events:
            if isinstance(event, BlocksStored):
                placed = self._store(state, *event)
                stored += placed
                unplaced += len(event.blocks) - placed
            elif isinstance(event, BlocksRemoved):
                removed += self._remove(state, event.engine_hashes)
            elif isinstance(event, CacheCleared):
                speculative -= len(state.speculative)
                self.clear(endpoint)
                cleared = True
        confirmed = speculative - len(state.speculative)
        if state.awaiting or endpoint in self.pending:
            self.pending[endpoint] = state.pending
            self.prefilling[endpoint] = state.prefilling
        return ApplyStats(stored, unplaced, removed, cleared, confirmed)

    def _store(self, state: _EndpointBlocks, blocks: Sequence[tuple[int, bytes]],
               parent_engine_hash: int | None, block_size: int,
               namespace: tuple[str, str]) -> int:
        """Place one BlocksStored chain (the event's fields, unpacked); the blocks placed.

        A block's token count is not checked (counting varints costs an allocation per block):
        no engine stores a partial block, and one could never match a prompt's full blocks. An
        empty one (ids sent unpacked, see `kvswitch.protocol.packed`) is left unplaced."""
        size = self.block_size
        parent: int | None
        by_engine = state.by_engine
        if parent_engine_hash is None:
            parent = root_hash(namespace)
        else:
            parent = by_engine.get(parent_engine_hash)
        if block_size and block_size != size:
            parent = None  # another block size can never match our queries
        placed = real = 0
        bit = 1 << state.bit
        speculative, holders, awaiting = state.speculative, self._holders, state.awaiting
        # The engine-hash table by `in` tests and subscripts, not get/pop calls (fewer calls per
        # block: ~25% less apply); the holder table read once and written only when it changes.
        for engine_hash, packed in blocks:
            if parent is not None and packed:
                parent = hash((parent, packed))
            else:
                parent = None
            if engine_hash in by_engine:
                extra = state.extra_copies
                extra[engine_hash] = extra.get(engine_hash, 0) + 1
                if parent is None or by_engine[engine_hash] is not None:
                    continue
                # A later store taught us the chain of an unplaced block: place it now.
            by_engine[engine_hash] = parent
            if parent is None:
                continue
            placed += 1
            held = holders.get(parent, 0)
            if not held & bit:
                holders[parent] = held | bit
            elif parent in speculative:
                del speculative[parent]  # confirmed: its bit is set already
            else:  # real already, under another engine hash
                owns = state.extra_owns
                owns[parent] = owns.get(parent, 0) + 1
                continue
            real += 1
            if awaiting:
                if parent in awaiting:
                    entry = awaiting.pop(parent)
                    state.pending -= entry[0]
                    state.prefilling -= entry[1]
                    _drop_checkpoints(state, entry)
                elif parent in state.checkpoints:
                    _progress(state, state.checkpoints.pop(parent))
        state.real += real
        return placed

    def _remove(self, state: _EndpointBlocks, engine_hashes: Iterable[int]) -> int:
        by_engine, extra, owns = state.by_engine, state.extra_copies, state.extra_owns
        holders, mask = self._holders, ~(1 << state.bit)
        pop_engine, pop_holders = by_engine.pop, holders.pop
        removed = gone = 0  # gone: no longer held here at all
        for engine_hash in engine_hashes:
            # None: stored unplaced, or before we subscribed (nothing to undo; never in extra).
            own = pop_engine(engine_hash, None)
            if extra and engine_hash in extra:
                by_engine[engine_hash] = own  # another physical copy still holds it
                _drop_copy(extra, engine_hash)
                continue
            if own is None:
                continue
            removed += 1
            if owns and own in owns:  # placed under another engine hash too: still held
                _drop_copy(owns, own)
                continue
            gone += 1
            held = pop_holders(own) & mask  # (another endpoint's bits go back)
            if held:
                holders[own] = held
        state.real -= gone
        return removed

    # -- speculative entries ---------------------------------------------------------------------

    def speculate(self, endpoint: str, hashes: Sequence[int], ttl: float,
                  held: int = 0) -> Speculation | None:
        """`hashes` (a request's own block hashes) were just routed to `endpoint`: hold them
        there for `ttl` seconds unless events confirm them sooner. `hashes[:held]` are known
        held already (`match` just said so) and are skipped: a prefix another request
        speculated keeps that request's expiry, the one its own BlockStored would meet.
        Endpoints the index does not know (not subscribed) are left alone. Returns the
        speculation for `withdraw` (None: nothing was speculated)."""
        state = self._endpoints.get(endpoint)
        if state is None or ttl <= 0 or held >= len(hashes):
            return None
        speculative, holders = state.speculative, self._holders
        bit, get = 1 << state.bit, holders.get
        # Not held here, or held only speculatively (real blocks are left alone).
        pending = [own for own in (hashes[held:] if held else hashes)
                   if not get(own, 0) & bit or own in speculative]
        if not pending:
            return None
        now = self.clock()
        self._expire(now)
        expiry = now + ttl
        # A plain loop: for the few blocks a request adds it beats building sets and dicts.
        for own in pending:
            if own not in speculative:
                # One dict call when no other endpoint holds the block (the usual case).
                mask = holders.setdefault(own, bit)
                if mask != bit:
                    holders[own] = mask | bit
            speculative[own] = expiry
        self._speculations += 1
        entry = (expiry, self._speculations, state, pending)
        expiries = self._expiries
        if not expiries or expiries[-1][0] <= expiry:
            expiries.append(entry)
        else:  # a shorter TTL than earlier calls': keep the order
            bisect.insort(expiries, entry)
        self._speculated_blocks += len(pending)
        bound = self.max_speculated_blocks
        while bound is not None and self._speculated_blocks > bound and len(expiries) > 1:
            self._drop(expiries.popleft())
        return entry

    def withdraw(self, speculation: Speculation | None) -> None:
        """The request that made `speculation` ended without a prefill (it failed, or was
        cancelled while queued): drop its blocks that are still speculative, except those a
        later speculation claimed (they keep its expiry)."""
        if speculation is not None:
            self._release_speculated(speculation)

    def _release_speculated(self, speculation: Speculation) -> None:
        """Drop the blocks of `speculation` still speculative whose latest claim is its own
        (or an earlier one's): what its expiry does."""
        expiry, _, state, hashes = speculation
        speculative = state.speculative
        # In C: the confirmed (the usual fate) and cleared ones drop out here; those
        # speculated again since keep their later expiry. `keys() &` walks the list
        # (set.intersection(dict) would walk every speculative entry of the endpoint).
        left = speculative.keys() & hashes
        if not left:
            return  # all confirmed: nothing to drop
        due = [own for own in left if speculative[own] <= expiry]
        for own in due:
            del speculative[own]
        self._release(due, state.bit)

    def _drop(self, speculation: Speculation) -> None:
        """`speculation` leaves `_expiries` (its time is up, or the bound is reached)."""
        self._speculated_blocks -= len(speculation[3])
        self._release_speculated(speculation)

    # -- prefill in progress -----------------------------------------------------------------

    def await_prefill(self, endpoint: str, hashes: Sequence[int], tokens: int, ttl: float,
                      held: int = 0) -> PrefillTicket | None:
        """A prompt of full blocks `hashes`, `held` of them already held there, was routed to
        `endpoint` with `tokens` to prefill: count them in `pending_prefill` until its last
        block is stored there (each checkpoint block stored lowers the count to what is left),
        the request ends (`end_prefill` with the ticket returned), or `ttl` seconds pass (its
        events were lost). None: not counted (an unknown or unindexed endpoint, nothing to
        prefill)."""
        state = self._endpoints.get(endpoint)
        if state is None or tokens <= 0 or not state.indexed or not hashes:
            return None
        now = self.clock()
        self._expire_awaited(now)
        last_hash = hashes[-1]
        entry = state.awaiting.get(last_hash)
        if entry is None:
            generation = next(self._generations)
            marks: list[int] = []
            blocks = len(hashes)
            # Positions p with p + 1 a multiple of PROGRESS_BLOCKS, past the held blocks and
            # before the last: the blocks after p are what is left once p is stored.
            first = held + PROGRESS_BLOCKS - 1 - held % PROGRESS_BLOCKS
            if first < blocks - 1:  # (a short prompt has none)
                size, checkpoints = self.block_size, state.checkpoints
                for p in range(first, blocks - 1, PROGRESS_BLOCKS):
                    mark = hashes[p]
                    checkpoints[mark] = (last_hash, generation, (blocks - 1 - p) * size)
                    marks.append(mark)
            entry = state.awaiting[last_hash] = [tokens, 1, generation, tokens, marks]
        else:
            entry[0] += tokens
            entry[1] += 1
            entry[3] += tokens
        state.pending += tokens
        state.prefilling += 1
        self.pending[endpoint] = state.pending
        self.prefilling[endpoint] = state.prefilling
        ticket = PrefillTicket(now + ttl, endpoint, state, last_hash, tokens, entry[2])
        self._awaiting.append(ticket)
        return ticket

    def _expire_awaited(self, now: float) -> None:
        expired = self._awaiting
        while expired and expired[0].until <= now:
            self.end_prefill(expired.popleft())

    def end_prefill(self, ticket: PrefillTicket | None) -> None:
        """The request `ticket` counts has ended: its prefill is over, whether or not the
        block's BlockStored has come yet (a second end, or one after the store, does nothing)."""
        if ticket is None or not ticket.live:
            return
        ticket.live = False
        state, block, tokens = ticket.state, ticket.last_hash, ticket.tokens
        entry = state.awaiting.get(block)
        if entry is None or entry[2] != ticket.generation:
            return  # stored already (or cleared): counted no more
        share = tokens * entry[0] // entry[3]  # this request's part of what is left
        if entry[1] > 1 and entry[0] > share:
            entry[0] -= share
            entry[1] -= 1
            entry[3] -= tokens
            state.pending -= share
            state.prefilling -= 1
        else:
            del state.awaiting[block]
            state.pending -= entry[0]
            state.prefilling -= entry[1]
            _drop_checkpoints(state, entry)
        self.pending[ticket.endpoint] = state.pending
        self.prefilling[ticket.endpoint] = state.prefilling

    def set_indexed(self, endpoint: str, indexed: bool) -> None:
        """Whether `endpoint`'s KV events are indexed (its block size is the index's)."""
        state = self._endpoints.get(endpoint)
        if state is not None:
            state.indexed = indexed
            if not indexed:
                self.clear(endpoint)

    def pending_prefill(self, endpoint: str) -> int:
        """Uncached prompt tokens routed to `endpoint` whose prefill has not ended yet."""
        state = self._endpoints.get(endpoint)
        return 0 if state is None else state.pending

    def prefilling_requests(self, endpoint: str) -> int:
        """Requests counted in `pending_prefill(endpoint)`."""
        state = self._endpoints.get(endpoint)
        return 0 if state is None else state.prefilling

    def expire(self) -> None:
        """Drop the speculative entries whose time is up (`match` does it too), and stop
        counting the prefills whose ttl has passed (`await_prefill` does it too)."""
        now = self.clock()
        self._expire(now)
        self._expire_awaited(now)

    def _expire(self, now: float) -> None:
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            self._drop(expiries.popleft())

    # -- queries -------------------------------------------------------------------------------

    def block_hashes(self, token_ids: Sequence[int],
                     namespace: tuple[str, str] = ("", "")) -> list[int]:
        return chained_block_hashes(token_ids, self.block_size, namespace)

    def match(self, hashes: Sequence[int],
              endpoints: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of `hashes` each endpoint holds, really or speculatively (every known
        or named endpoint)."""
        names = tuple(self._endpoints) if endpoints is None else tuple(endpoints)
        result = dict.fromkeys(names, 0)
        result.update(self.match_held(hashes, names))
        return result

    def match_held(self, hashes: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """`match` of the named endpoints without its zeros: only those holding the first block
        (absent means 0). Per request, a miss then builds nothing per endpoint."""
        if self._expiries:
            self._expire(self.clock())
        result: dict[str, int] = {}
        get = self._holders.get
        first = get(hashes[0], 0) if hashes else 0
        if not first:
            return result  # nobody holds the first block (a new prefix)
        names = endpoints if isinstance(endpoints, tuple) else tuple(endpoints)
        named, by_bit = self._tables.get(names) or self._table(names)
        alive = first & named
        if not alive:
            return result
        position = 0
        for position, own in enumerate(hashes):
            held = alive & get(own, 0)
            if held != alive:
                self._record(alive & ~held, by_bit, position, result)
                alive = held
                if not alive:
                    return result
        self._record(alive, by_bit, len(hashes), result)
        return result

    @staticmethod
    def _record(dropped: int, by_bit: Mapping[int, str], length: int,
                result: dict[str, int]) -> None:
        """These endpoints (bits) hold exactly the first `length` blocks."""
        while dropped:
            low = dropped & -dropped
            result[by_bit[low]] = length
            dropped ^= low

    def _table(self, names: tuple[str, ...]) -> tuple[int, dict[int, str]]:
        """(mask of the named endpoints' bits, bit -> name) for `match`, kept per name tuple:
        requests name the same endpoints over and over."""
        states = self._endpoints
        by_bit = {1 << states[n].bit: n for n in names if n in states}
        if len(self._tables) >= 64:
            self._tables.clear()  # only a churning pool gets here: start over
        table = self._tables[names] = (sum(by_bit), by_bit)
        return table

    def match_tokens(self, token_ids: Sequence[int],
                     endpoints: Iterable[str] | None = None) -> dict[str, int]:
        """Leading prompt tokens each endpoint holds in its cache (full blocks only)."""
        hashes = self.block_hashes(token_ids)
        return {e: n * self.block_size for e, n in self.match(hashes, endpoints).items()}
