"""Discovery: where the endpoint set comes from.

`Discovery` is a one-method seam: `watch()` yields the full endpoint set each time it changes.
`StaticDiscovery` serves the list from the pool file once; a Kubernetes watcher (pods matching
`InferencePool.spec.selector`) can implement the same protocol later.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from kvswitch.epp.datalayer.endpoint import EndpointSpec


@runtime_checkable
class Discovery(Protocol):
    def watch(self) -> AsyncIterator[Sequence[EndpointSpec]]:
        """Yield the complete endpoint set now and after every change."""
        ...


class StaticDiscovery:
    """A fixed endpoint list (the pool file outside Kubernetes)."""

    def __init__(self, endpoints: Sequence[EndpointSpec]) -> None:
        self.endpoints = tuple(endpoints)

    async def watch(self) -> AsyncIterator[Sequence[EndpointSpec]]:
        yield self.endpoints
        # A static set never changes; park until cancelled.
        await asyncio.Event().wait()
