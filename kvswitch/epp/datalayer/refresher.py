"""Background refresh: follow discovery, and refresh every endpoint every `interval` seconds.

One asyncio task per endpoint runs `collector.collect()` in a loop; success updates the
endpoint's metrics, failure marks it not ready. Staleness is judged by `Datalayer.ready()`.
While the endpoint's load is pushed (KV-event stream live, `Endpoint.live_until`), polling
drops to once per `push_poll_interval` seconds (1 s): it then only confirms health (GetLoads
doubles as the liveness probe, HealthCheck + GetServerInfo ride along on their own period).
Engines without events, or whose stream dropped, and endpoints not healthy are polled every
`interval`. When a collector's connection drops (an engine that died closes it), the endpoint is
polled at once rather than at its next poll: a dead engine leaves the ready set within a
connection attempt, not up to `push_poll_interval` later.
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
from kvswitch.tls import UpstreamTls

log = logging.getLogger(__name__)

CollectorFactory = Callable[[EndpointSpec, Callable[[], None]], Collector]
"""(endpoint, on_disconnect) -> its collector; the collector calls `on_disconnect()` when its
connection to the endpoint drops (collectors without a standing connection never do)."""


def default_collector(spec: EndpointSpec, on_disconnect: Callable[[], None], *,
                      tls: UpstreamTls | None = None) -> Collector:
    """gRPC GetLoads for h2c endpoints, Prometheus /metrics for http ones; over TLS with
    `tls`."""
    if spec.app_protocol == H2C:
        return GrpcCollector(spec.address, on_disconnect=on_disconnect, api=spec.api, tls=tls)
    return PrometheusCollector(spec.address, tls=tls)


class _Alarm:
    """A sleep that `ring()` cuts short; a ring while awake is kept for the next check."""

    def __init__(self) -> None:
        self.rung = False
        self._waiter: asyncio.Future[None] | None = None

    def ring(self) -> None:
        self.rung = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def sleep(self, seconds: float) -> None:
        if self.rung:
            return
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(seconds, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Refresher:
    def __init__(self, datalayer: Datalayer, discovery: Discovery, interval: float = 0.05,
                 collector_factory: CollectorFactory = default_collector,
                 push_poll_interval: float = 1.0) -> None:
        self.datalayer = datalayer
        self.discovery = discovery
        self.interval = interval
        self.push_poll_interval = push_poll_interval
        self.polls = 0
        """Collector calls made (all endpoints), for tests and benchmarks."""
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
        disconnected = _Alarm()
        collector = self.collector_factory(spec, disconnected.ring)
        clock = self.datalayer.clock
        endpoint = self.datalayer.get(spec.address)
        last_poll = float("-inf")
        try:
            while True:
                started = clock()
                pushed = (endpoint is not None and endpoint.healthy
                          and endpoint.live_until >= started)
                if (not pushed or disconnected.rung
                        or started - last_poll >= self.push_poll_interval):
                    disconnected.rung = False
                    last_poll = started
                    await self._poll(collector, spec.address, started)
                wake = started + self.interval
                if pushed and endpoint is not None and endpoint.healthy:  # (a failed poll retries)
                    # Sleep to the next health poll, or to when pushes would have gone quiet.
                    wake = max(wake, min(last_poll + self.push_poll_interval,
                                         endpoint.live_until))
                await disconnected.sleep(max(0.0, wake - clock()))
        finally:
            await collector.close()

    async def _poll(self, collector: Collector, address: str, now: float) -> None:
        self.polls += 1
        try:
            metrics = await collector.collect(now)
        except CollectorError as exc:
            log.debug("refresh failed: %s", exc)
            self.datalayer.mark_failed(address)
        else:
            self.datalayer.update(address, metrics)
