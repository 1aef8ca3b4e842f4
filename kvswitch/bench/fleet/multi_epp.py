"""Several EPP replicas routing one workload, as `kvswitch up --epp-replicas N` runs them.

`MultiEppRouter(config, replicas)`: N independent `EppRouter`s over the same fleet, each with its
own data layer, prefix index, speculative entries and in-flight counts, and each subscribed to
every engine's KV events. Envoy hands each request to one of them in turn (its least-request
balancing over ext_proc streams that last a few milliseconds is round robin in effect), and the
request's end goes back to the replica that routed it, as the access-log signature does. The
engines' load pushes after each arrival reach every replica (`kv_subscribers` = N), with the
prompts of the requests that arrived since the previous push, still in prefill. What the replicas
do not share (each one's speculative entries until that push, in-flight counts) is what this
measures.
`kill(i)` takes replica i out at once, as a crash would (the survivors route everything from
then on and never counted what it had in flight).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvswitch.bench.fleet.epp import EppRouter
from kvswitch.bench.fleet.routers import FleetContext
from kvswitch.engine.base import EngineLoadSnapshot, KvEventBatchData, QueuedPrompt

__all__ = ["MultiEppRouter"]


class MultiEppRouter:
    def __init__(self, config: Path | str | Mapping[str, Any] | None, replicas: int,
                 name: str = "epp", kv_delay: float = 0.002, seed: int = 0) -> None:
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        self.name = name
        self.epps = [EppRouter(config, f"{name}#{i}", kv_delay, seed * 1_000 + i)
                     for i in range(replicas)]
        self.alive = list(self.epps)
        """The replicas Envoy sends requests to and the engines stream to."""
        self._next = 0
        self._routed_by: dict[int, EppRouter] = {}
        self.kv_subscribers = replicas

    def setup(self, ctx: FleetContext) -> None:
        for epp in self.epps:
            epp.setup(ctx)

    def kill(self, index: int) -> None:
        """Replica `index` dies: no request, KV batch, load push or request end reaches it from
        now on, and the engines count one subscriber fewer (one left: no more pushes)."""
        alive = [epp for epp in self.alive if epp is not self.epps[index]]
        if not alive:
            raise ValueError("the last EPP replica cannot be killed")
        self.alive = alive
        self._next %= len(alive)
        self.kv_subscribers = len(self.alive)

    def route(self, request: Any, now: float) -> int | None:
        epp = self.alive[self._next]
        self._next = (self._next + 1) % len(self.alive)
        self._routed_by[request.index] = epp
        return epp.route(request, now)

    def first_token(self, request: Any, replica: int, now: float) -> None:
        epp = self._routed_by[request.index]
        if epp in self.alive:
            epp.first_token(request, replica, now)

    def finished(self, request: Any, replica: int, now: float) -> None:
        epp = self._routed_by.pop(request.index)
        if epp in self.alive:
            epp.finished(request, replica, now)

    def kv_batch(self, replica: int, batch: KvEventBatchData, now: float) -> None:
        for epp in self.alive:
            epp.kv_batch(replica, batch, now)

    def load_push(self, replica: int, load: EngineLoadSnapshot, now: float,
                  queued: tuple[QueuedPrompt, ...] = ()) -> None:
        for epp in self.alive:
            epp.load_push(replica, load, now, queued)
