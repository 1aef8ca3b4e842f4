"""Discovery: where the endpoint set comes from.

`Discovery` is a one-method seam: `watch()` yields the full endpoint set each time it changes.
`StaticDiscovery` serves the list from the pool file once; `KubernetesDiscovery`
(kube_discovery.py) follows an InferencePool and its pods. A discovery may also report whether
it can read its pool (`ReportsHealth`: the EPP's readiness follows it) and supply objective
priorities (`SuppliesObjectives`: the router's follow them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from kvswitch.epp.datalayer.endpoint import EndpointSpec


@runtime_checkable
class Discovery(Protocol):
    def watch(self) -> AsyncIterator[Sequence[EndpointSpec]]:
        """Yield the complete endpoint set now and after every change."""
        ...


@runtime_checkable
class ReportsHealth(Protocol):
    def add_health_listener(self, listener: Callable[[bool, str], None]) -> None:
        """Call `listener(ready, problem)` now and whenever readiness changes."""
        ...


@runtime_checkable
class SuppliesObjectives(Protocol):
    on_objectives: Callable[[Mapping[str, int]], None] | None
    """Set by the router's builder; called with objective name -> priority on each change."""


class StaticDiscovery:
    """A fixed endpoint list (the pool file outside Kubernetes)."""

    def __init__(self, endpoints: Sequence[EndpointSpec]) -> None:
        self.endpoints = tuple(endpoints)

    async def watch(self) -> AsyncIterator[Sequence[EndpointSpec]]:
        yield self.endpoints
        # A static set never changes; park until cancelled.
        await asyncio.Event().wait()
