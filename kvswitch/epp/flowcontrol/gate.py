"""The asyncio side of flow control: queued requests wait on futures; a ticker pumps queues.

`FlowGate.admit()` returns at once in the common case (pool not saturated, nothing queued).
Otherwise the request waits until `pump()` - run every `tick` seconds, and after every finished
request - releases it (headroom appeared) or expires it (maxWait). A waiter cancelled while
queued (its ext_proc stream was reset) leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence

from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.flowcontrol.core import (
    DISPATCH,
    EXPIRED,
    Admission,
    FlowControlConfig,
    FlowQueues,
    SaturationConfig,
    Verdict,
    headroom,
    is_saturated,
)


class FlowGate:
    def __init__(self, endpoints: Callable[[], Sequence[Endpoint]],
                 saturation: SaturationConfig | None = None,
                 config: FlowControlConfig | None = None, tick: float = 0.05,
                 clock: Callable[[], float] = time.monotonic, queueing: bool = True) -> None:
        self.endpoints = endpoints
        self.saturation = saturation or SaturationConfig()
        self.queues = FlowQueues(config, queueing)
        self.tick = tick
        self.clock = clock
        self._keys = itertools.count()
        self._waiters: dict[int, asyncio.Future[Admission]] = {}
        self._ticker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._ticker = asyncio.create_task(self._run(), name="epp-flow-control")

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None

    def saturated(self) -> bool:
        return is_saturated(self.endpoints(), self.saturation)

    def dispatches_now(self, priority: int, candidates: Sequence[Endpoint]) -> bool:
        """What `admit` answers at once in the common case: nothing queued and the pool not
        saturated. Callers skip `admit`'s awaitable then (~1 us per request)."""
        if self._waiters:
            return False
        now = self.clock() if priority < 0 else None
        return not is_saturated(candidates, self.saturation, now)

    async def admit(self, fairness_id: str, priority: int,
                    candidates: Sequence[Endpoint]) -> Admission:
        """DISPATCH, or a REJECTED admission (429/503) with its reason."""
        # Sheddable requests are shed when unsure (stale metrics count as saturated); others
        # queue on load alone.
        saturated = is_saturated(candidates, self.saturation,
                                 self.clock() if priority < 0 else None)
        if not saturated and not self._waiters:
            return DISPATCH
        key = next(self._keys)
        admission = self.queues.admit(key, fairness_id, priority, saturated, self.clock())
        if admission.verdict is not Verdict.QUEUED:
            return admission
        future: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._waiters[key] = future
        if not saturated:
            self.pump()
        try:
            return await future
        except asyncio.CancelledError:
            # The caller is gone (Envoy reset the ext_proc stream): give the queue slot back,
            # and if headroom had already been released to it, hand that on to the next waiter.
            self.queues.remove(key)
            self._waiters.pop(key, None)
            if future.done() and not future.cancelled() and future.result() is DISPATCH:
                self.pump()
            raise
        finally:
            self._waiters.pop(key, None)

    def pump(self) -> None:
        """Expire overdue requests and release as many as the pool has headroom for."""
        if not self._waiters:
            return
        for key in self.queues.expire(self.clock()):
            self._resolve(key, EXPIRED)
        endpoints = self.endpoints()
        for key in self.queues.release(headroom(endpoints, self.saturation)):
            self._resolve(key, DISPATCH)

    def _resolve(self, key: int, admission: Admission) -> None:
        future = self._waiters.pop(key, None)
        if future is not None and not future.done():
            future.set_result(admission)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick)
            self.pump()
