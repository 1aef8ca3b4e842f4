"""Background refresh: follow discovery, and refresh every endpoint every `interval` seconds.

One asyncio task per endpoint runs `collector.collect()` in a loop; success updates the
endpoint's metrics, failure marks it not ready. Staleness (no success within `staleness`
seconds, default 4 intervals) is judged by `Datalayer.ready()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from kvswitch.epp.datalayer.collectors import (
    Collector,
    CollectorError,
    GrpcCollector,
    PrometheusCollector,
)
from kvswitch.epp.datalayer.discovery import Discovery
from kvswitch.epp.datalayer.endpoint import H2C, Datalayer, EndpointSpec

log = logging.getLogger(__name__)

CollectorFactory = Callable[[EndpointSpec], Collector]


def default_collector(spec: EndpointSpec) -> Collector:
    """gRPC GetLoads for h2c endpoints, Prometheus /metrics for http ones."""
    if spec.app_protocol == H2C:
        return GrpcCollector(spec.address)
    return PrometheusCollector(spec.address)


class Refresher:
    def __init__(self, datalayer: Datalayer, discovery: Discovery, interval: float = 0.05,
                 collector_factory: CollectorFactory = default_collector) -> None:
        self.datalayer = datalayer
        self.discovery = discovery
        self.interval = interval
        self.collector_factory = collector_factory
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._watch: asyncio.Task[None] | None = None
        self._first_set = asyncio.Event()

    async def start(self) -> None:
        self._watch = asyncio.create_task(self._follow_discovery(), name="epp-discovery")
        # The endpoint set must be known before the first request is routed.
        await asyncio.wait({self._watch, asyncio.create_task(self._first_set.wait())},
                           return_when=asyncio.FIRST_COMPLETED)

    async def stop(self) -> None:
        tasks = [t for t in (self._watch, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _follow_discovery(self) -> None:
        async for specs in self.discovery.watch():
            added, removed = self.datalayer.set_endpoints(specs)
            by_address = {s.address: s for s in specs}
            for address in removed:
                task = self._tasks.pop(address, None)
                if task is not None:
                    task.cancel()
            for endpoint in added:
                spec = by_address[endpoint.address]
                self._tasks[spec.address] = asyncio.create_task(
                    self._refresh_loop(spec), name=f"epp-refresh-{spec.address}")
            self._first_set.set()

    async def _refresh_loop(self, spec: EndpointSpec) -> None:
        collector = self.collector_factory(spec)
        clock = self.datalayer.clock
        try:
            while True:
                started = clock()
                try:
                    metrics = await collector.collect(started)
                except CollectorError as exc:
                    log.debug("refresh failed: %s", exc)
                    self.datalayer.mark_failed(spec.address)
                else:
                    self.datalayer.update(spec.address, metrics)
                await asyncio.sleep(max(0.0, self.interval - (clock() - started)))
        finally:
            await collector.close()
