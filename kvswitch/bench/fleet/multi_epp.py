"""Several EPP replicas routing one workload, as `kvswitch up --epp-replicas N` runs them.

`MultiEppRouter(config, replicas)`: N independent `EppRouter`s over the same fleet, each with its
own data layer, prefix index, speculative entries and in-flight counts, and each subscribed to
every engine's KV events. Envoy hands each request to one of them in turn (its least-request
balancing over ext_proc streams that last a few milliseconds is round robin in effect), and the
request's end goes back to the replica that routed it, as the access-log signature does. The
engines' load pushes after each arrival reach every replica (`kv_subscribers` = N). What the
replicas do not share (speculative entries, in-flight counts) is what this measures.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvswitch.bench.fleet.epp import EppRouter
from kvswitch.bench.fleet.routers import FleetContext
from kvswitch.engine.base import EngineLoadSnapshot, KvEventBatchData

__all__ = ["MultiEppRouter"]


class MultiEppRouter:
    def __init__(self, config: Path | str | Mapping[str, Any] | None, replicas: int,
                 name: str = "epp", kv_delay: float = 0.002, seed: int = 0) -> None:
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        self.name = name
        self.epps = [EppRouter(config, f"{name}#{i}", kv_delay, seed * 1_000 + i)
                     for i in range(replicas)]
        self._next = 0
        self._routed_by: dict[int, EppRouter] = {}
        self.kv_subscribers = replicas

    def setup(self, ctx: FleetContext) -> None:
        for epp in self.epps:
            epp.setup(ctx)

    def route(self, request: Any, now: float) -> int | None:
        epp = self.epps[self._next]
        self._next = (self._next + 1) % len(self.epps)
        self._routed_by[request.index] = epp
        return epp.route(request, now)

    def first_token(self, request: Any, replica: int, now: float) -> None:
        self._routed_by[request.index].first_token(request, replica, now)

    def finished(self, request: Any, replica: int, now: float) -> None:
        self._routed_by.pop(request.index).finished(request, replica, now)

    def kv_batch(self, replica: int, batch: KvEventBatchData, now: float) -> None:
        for epp in self.epps:
            epp.kv_batch(replica, batch, now)

    def load_push(self, replica: int, load: EngineLoadSnapshot, now: float) -> None:
        for epp in self.epps:
            epp.load_push(replica, load, now)
