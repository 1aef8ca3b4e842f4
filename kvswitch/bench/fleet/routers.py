"""Routers the fleet simulator can run, besides the EPP (`fleet.epp`): baselines and references.

The contract (`FleetRouter`): `setup(ctx)` once, then per request `route(request, now)` -> the
replica index, or None when the router holds the request and will call `ctx.dispatch` /
`ctx.reject` itself later; `first_token`, `finished` as they happen; `kv_batch(replica, batch,
now)` for every KV event batch a replica publishes (the router applies its own delivery delay).

- `RoundRobin`, `RandomRouter` (seeded): what Envoy's round robin and random do.
- `Oracle`: `kvswitch.bench.oracle.OracleRouter` (the bench's greedy oracle, shared code) fed at
  once with every replica's KV event batches and told exactly when each first token comes out:
  perfect, immediate information. `conserve` picks its variant (see the oracle module).
- `LookaheadOracle`: the oracle that also looks at the arrivals of the next `horizon` seconds
  (at most `depth`): for each candidate replica of this request it places those arrivals
  greedily on top of it (queues frozen, prefix matches of the look-ahead requests among
  themselves counted) and picks the replica whose placement gives the smallest sum of
  estimated TTFTs. A router cannot know the future; this one peeks, as a reference only.
- `SmgCacheAwareModel`: a MODEL of SMG's `cache_aware` policy, written from its documented
  rule, not SMG itself. Per replica it counts its own requests in flight (load). Imbalanced when
  max - min load > 32 and max > 1.1 x min: the least-loaded replica (ties: fewer requests
  routed so far, then lowest index). Otherwise, in mode "events" (`smg-cache-aware-model`, what
  SMG runs when the engines stream KV events, as kvswitch's do): the replica whose KV cache (from
  the engines' coalesced KV events, `kv_delay` after publication) holds the longest prefix of the
  prompt, ties to the least loaded then the smallest cache, and the least-loaded replica when no
  replica holds any of it. In mode "tree" (`smg-cache-aware-tree-model`, SMG without KV events):
  the replica it routed the longest prefix to (its approximate tree, never evicted here; SMG
  evicts LRU leaves past a size bound) when matched / prompt tokens > 0.5 (ties: least load),
  else the replica with the smallest tree. Matching is per 16-token block.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvswitch.bench.oracle import OracleRouter
from kvswitch.engine.base import EngineLoadSnapshot, KvEventBatchData, QueuedPrompt
from kvswitch.engine.sim.profiles import SimProfile
from kvswitch.epp.kvindex import BlocksRemoved, BlocksStored, KvBlockIndex, StoredBlock
from kvswitch.epp.kvindex.hashing import chained_block_hashes


class FleetContext(Protocol):
    """What the fleet offers a router."""

    @property
    def replicas(self) -> Sequence[Any]:
        """`Replica` objects (index, address, profile)."""
        ...

    requests: Sequence[Any]
    """The workload's requests, in arrival order (only references may look ahead)."""
    profile: SimProfile

    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> None: ...

    def dispatch(self, request: Any, replica: int) -> None: ...

    def reject(self, request: Any, reason: str) -> None: ...


class FleetRouter(Protocol):
    name: str
    kv_subscribers: int
    """KV-event streams it holds per replica (several EPPs: one each); with two or more the
    replicas push their load after each arrival (`load_push`)."""

    def setup(self, ctx: FleetContext) -> None: ...

    def route(self, request: Any, now: float) -> int | None: ...

    def first_token(self, request: Any, replica: int, now: float) -> None: ...

    def finished(self, request: Any, replica: int, now: float) -> None: ...

    def kv_batch(self, replica: int, batch: KvEventBatchData, now: float) -> None: ...

    def load_push(self, replica: int, load: EngineLoadSnapshot, now: float,
                  queued: tuple[QueuedPrompt, ...] = ()) -> None: ...


class _Base:
    name = "base"
    kv_subscribers = 0

    def setup(self, ctx: FleetContext) -> None:
        self.ctx = ctx
        self.n = len(ctx.replicas)

    def first_token(self, request: Any, replica: int, now: float) -> None:
        pass

    def finished(self, request: Any, replica: int, now: float) -> None:
        pass

    def kv_batch(self, replica: int, batch: KvEventBatchData, now: float) -> None:
        pass

    def load_push(self, replica: int, load: EngineLoadSnapshot, now: float,
                  queued: tuple[QueuedPrompt, ...] = ()) -> None:
        pass


class RoundRobin(_Base):
    name = "round-robin"

    def setup(self, ctx: FleetContext) -> None:
        super().setup(ctx)
        self._next = 0

    def route(self, request: Any, now: float) -> int:
        pick = self._next
        self._next = (pick + 1) % self.n
        return pick


class RandomRouter(_Base):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def setup(self, ctx: FleetContext) -> None:
        super().setup(ctx)
        self._rng = random.Random(self.seed)

    def route(self, request: Any, now: float) -> int:
        return self._rng.randrange(self.n)


def stored_events(batch: KvEventBatchData, block_size: int) -> list[Any]:
    """An engine batch as the index's events (removals first, then each block under its
    parent), without the protobuf round trip: what a subscriber in the same process would apply."""
    events: list[Any] = []
    if batch.removed:
        events.append(BlocksRemoved(tuple(batch.removed)))
    for block in batch.stored:
        events.append(BlocksStored((StoredBlock.of(block.block_hash, block.token_ids),),
                                   block.parent_block_hash, block_size))
    return events


class Oracle(_Base):
    """The bench's greedy oracle with perfect, immediate information."""

    def __init__(self, conserve: float = 0.0, name: str = "oracle") -> None:
        self.conserve = conserve
        self.name = name

    def setup(self, ctx: FleetContext) -> None:
        super().setup(ctx)
        self.addresses = [r.address for r in ctx.replicas]
        self.index = KvBlockIndex(ctx.profile.block_size, clock=ctx.now)
        for a in self.addresses:
            self.index.add_endpoint(a)
        self.oracle = OracleRouter(self.addresses, ctx.profile, self.index, clock=ctx.now,
                                   conserve=self.conserve)

    def route(self, request: Any, now: float) -> int:
        return self.addresses.index(self.oracle.choose(request))

    def first_token(self, request: Any, replica: int, now: float) -> None:
        self.oracle.first_token(request)

    def finished(self, request: Any, replica: int, now: float) -> None:
        self.oracle.finished(request, None)

    def kv_batch(self, replica: int, batch: KvEventBatchData, now: float) -> None:
        self.index.apply(self.addresses[replica],
                         stored_events(batch, self.ctx.profile.block_size))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class LookaheadOracle(Oracle):
    """The oracle choosing with the next arrivals in view (see the module docstring)."""

    def __init__(self, horizon: float = 1.0, depth: int = 6,
                 name: str = "oracle-lookahead") -> None:
        super().__init__(0.0, name)
        self.horizon = horizon
        self.depth = depth

    def setup(self, ctx: FleetContext) -> None:
        super().setup(ctx)
        self._position = {r.index: i for i, r in enumerate(ctx.requests)}
        self._hashes: dict[int, list[int]] = {}

    def _hashes_of(self, request: Any) -> list[int]:
        h = self._hashes.get(request.index)
        if h is None:
            h = self._hashes[request.index] = self.index.block_hashes(request.prompt_ids)
        return h

    def route(self, request: Any, now: float) -> int:
        requests = self.ctx.requests
        i = self._position[request.index] + 1
        ahead: list[Any] = []
        while (i < len(requests) and len(ahead) < self.depth
               and requests[i].send_at <= request.send_at + self.horizon):
            ahead.append(requests[i])
            i += 1
        if not ahead:
            return super().route(request, now)
        self._hashes.pop(request.index, None)
        group = [request, *ahead]
        hashes = [self._hashes_of(r) for r in group]
        o, size = self.oracle, self.index.block_size
        o._settle_prefills()
        # Per request and replica: leading blocks cached or soon cached there now.
        held = []
        for h in hashes:
            cached = self.index.match(h, self.addresses)
            soon = o.pending.match(h, self.addresses)
            held.append([max(cached[a], soon[a]) for a in self.addresses])
        shared = [[_common_prefix(hashes[j], hashes[k]) for k in range(len(group))]
                  for j in range(len(group))]
        base = [(o.queues[a].pending_prefill, o.queues[a].decoding, o.queues[a].decode_context)
                for a in self.addresses]
        best: tuple[float, int] | None = None
        for first in range(self.n):
            pending = [b[0] for b in base]
            placed: list[list[int]] = [[] for _ in range(self.n)]
            total = 0.0
            for j, r in enumerate(group):
                n = len(r.prompt_ids)
                pick, pick_cost, pick_uncached = first, float("inf"), 0
                for e in ([first] if j == 0 else range(self.n)):
                    blocks = max([held[j][e], *(shared[j][k] for k in placed[e])])
                    uncached = n - min(blocks * size, n - 1)
                    cost = o.prefill_seconds(pending[e] + uncached, base[e][1], base[e][2])
                    if cost < pick_cost:
                        pick, pick_cost, pick_uncached = e, cost, uncached
                pending[pick] += pick_uncached
                placed[pick].append(j)
                total += pick_cost
            if best is None or total < best[0]:
                best = (total, first)
        assert best is not None
        return self._place(request, best[1])

    def _place(self, request: Any, replica: int) -> int:
        """Book the request on `replica` as `OracleRouter.choose` books its own pick."""
        o, address = self.oracle, self.addresses[replica]
        hashes = self.index.block_hashes(request.prompt_ids)
        n, size = len(request.prompt_ids), self.index.block_size
        cached = self.index.match(hashes, (address,))[address]
        soon = o.pending.match(hashes, (address,))[address]
        uncached = n - min(max(cached, soon) * size, n - 1)
        o._send(request, address, hashes, uncached)
        return replica


class SmgCacheAwareModel(_Base):
    """A model of SMG's cache_aware policy (see the module docstring)."""

    def __init__(self, mode: str = "events", cache_threshold: float = 0.5,
                 balance_abs: int = 32, balance_rel: float = 1.1,
                 kv_delay: float = 0.002) -> None:
        if mode not in ("events", "tree"):
            raise ValueError(f"unknown SMG model mode {mode!r}")
        self.mode = mode
        self.name = "smg-cache-aware-model" if mode == "events" else "smg-cache-aware-tree-model"
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.kv_delay = kv_delay

    def setup(self, ctx: FleetContext) -> None:
        super().setup(ctx)
        self.addresses = [r.address for r in ctx.replicas]
        self.block_size = ctx.profile.block_size
        # events: the engines' caches from their KV events; tree: "routed there" entries that
        # never expire (the approximate tree), however many.
        self.index = KvBlockIndex(self.block_size, clock=ctx.now, max_speculated_blocks=None)
        for a in self.addresses:
            self.index.add_endpoint(a)
        self.load = [0] * self.n
        self.processed = [0] * self.n

    def _least_loaded(self) -> int:
        # (load, processed requests, index): SMG's tie-break for shortest queue.
        return min(range(self.n), key=lambda i: (self.load[i], self.processed[i], i))

    def _size(self, i: int) -> int:
        a = self.addresses[i]
        return (self.index.num_blocks(a) if self.mode == "events"
                else self.index.num_speculative(a))

    def route(self, request: Any, now: float) -> int:
        load = self.load
        low, high = min(load), max(load)
        hashes = chained_block_hashes(request.prompt_ids, self.block_size)
        matched = self.index.match(hashes, self.addresses) if hashes else {}
        best = max(matched.values(), default=0)
        if high - low > self.balance_abs and high > self.balance_rel * low:
            pick = self._least_loaded()
        elif self.mode == "events":
            if best:
                pick = min((load[i], self._size(i), i) for i, a in enumerate(self.addresses)
                           if matched[a] == best)[2]
            else:
                pick = self._least_loaded()
        elif best and best * self.block_size / max(1, len(request.prompt_ids)) \
                > self.cache_threshold:
            pick = min((load[i], i) for i, a in enumerate(self.addresses)
                       if matched[a] == best)[1]
        else:
            pick = min(range(self.n), key=lambda i: (self._size(i), i))
        if hashes and self.mode == "tree":
            address = self.addresses[pick]
            self.index.speculate(address, hashes, float("inf"), held=matched.get(address, 0))
        load[pick] += 1
        self.processed[pick] += 1
        return pick

    def finished(self, request: Any, replica: int, now: float) -> None:
        self.load[replica] -= 1

    def kv_batch(self, replica: int, batch: KvEventBatchData, now: float) -> None:
        if self.mode == "events":
            events = stored_events(batch, self.block_size)
            address = self.addresses[replica]

            def apply() -> None:
                self.index.apply(address, events)

            self.ctx.call_at(now + self.kv_delay, apply)
