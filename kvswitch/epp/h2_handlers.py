"""The EPP's services on the h2 transport (`kvswitch.epp.h2server`): one handler per stream.

- `ProcessCall`: `ExternalProcessor.Process`, driving `ExtProcStream` straight from its frames.
  `router.route()` is stepped by hand (`start_route`): only a request that really waits (flow
  control queued it) gets a task; messages that arrive meanwhile wait behind it, in order.
- `HealthCheckCall`, `HealthWatchCall`: `grpc.health.v1.Health` from the server's status table.
- `AccessLogCall`: `AccessLogService.StreamAccessLogs`, each message's entries to the router.
"""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Coroutine, Generator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from kvswitch.epp.access_log import AccessLogSink
from kvswitch.epp.contracts import EndpointPicker, Router, RoutingDecision
from kvswitch.epp.extproc import Action, ExtProcStream, NeedRouting
from kvswitch.epp.h2server import INTERNAL, NOT_FOUND, Call
from kvswitch.epp.serving import (
    ROUTER_ERROR,
    SERVICE_UNKNOWN,
    decided,
    report_finished,
    take_entries,
)

logger = logging.getLogger(__name__)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, RoutingDecision], yielded: Any) -> Generator[Any, Any, Any]:
    """Carry on a coroutine already stepped once by hand (what Python 3.12's eager tasks do)."""
    while True:
        try:
            sent = yield yielded
        except BaseException as exc:  # noqa: BLE001 - cancellation too: thrown into the coroutine
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as stop:
                return stop.value


async def _finish_route(coro: Coroutine[Any, Any, RoutingDecision],
                        yielded: Any) -> RoutingDecision:
    decision: RoutingDecision = await _resume(coro, yielded)
    return decision


def start_route(router: Router, need: NeedRouting
                ) -> RoutingDecision | asyncio.Task[RoutingDecision]:
    """The decision if `route()` finishes without waiting (the usual case), else a task."""
    coro = router.route(need.request, need.subset)
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        decision: RoutingDecision = stop.value
        return decision
    return asyncio.get_running_loop().create_task(_finish_route(coro, yielded))


class ProcessCall:
    """`ExternalProcessor.Process` on the h2 transport: `ExtProcServicer.Process`, frame-driven.

    While a routing task runs, later messages and the end of input wait (`_backlog`) so the
    stream sees them in order. `close()` reports a routed request exactly once: at the end of
    input, at a reset (after a pending route settles, so a decision made meanwhile is
    released too) or when the connection drops."""

    __slots__ = ("_backlog", "_call", "_ended", "_gone", "_rest", "_router", "_stream", "_task")

    def __init__(self, picker: EndpointPicker, call: Call) -> None:
        self._call = call
        self._router = picker.router
        self._stream = ExtProcStream(picker)
        self._task: asyncio.Task[RoutingDecision] | None = None
        self._backlog: list[bytes] | None = None
        self._rest: list[Action] = []
        self._ended = False
        self._gone = False

    def on_message(self, message: bytes) -> None:
        if self._backlog is not None:
            self._backlog.append(message)
            return
        try:
            request = ep.ProcessingRequest.FromString(message)
        except DecodeError:
            self._gone = True
            self._call.finish(INTERNAL, "cannot parse a ProcessingRequest")
            report_finished(self._router, self._stream.close())
            return
        self._perform(self._stream.receive(request))

    def on_end(self) -> None:
        if self._task is not None:
            self._ended = True
        else:
            self._end()

    def on_reset(self) -> None:
        self._gone = True
        if self._task is not None:
            self._task.cancel()  # its callback closes the stream
        else:
            report_finished(self._router, self._stream.close())

    def _perform(self, actions: list[Action]) -> None:
        send = self._call.send
        for i, action in enumerate(actions):
            kind = type(action)
            if kind is bytes:
                send(action)  # type: ignore[arg-type]
            elif kind is NeedRouting:
                if not self._route(action, actions[i + 1:]):  # type: ignore[arg-type]
                    return
            else:
                report_finished(self._router, [action])

    def _route(self, need: NeedRouting, rest: list[Action]) -> bool:
        """True if routed now; False if a task will finish it (and then `rest`)."""
        try:
            pending = start_route(self._router, need)
        except Exception:
            logger.exception("router failed on request %s", need.request.request_id)
            pending = ROUTER_ERROR
        if isinstance(pending, RoutingDecision):
            self._perform(self._stream.routed(decided(need, pending)))
            return True
        self._task, self._backlog, self._rest = pending, [], rest
        pending.add_done_callback(lambda task: self._routed_later(need, task))
        return False

    def _routed_later(self, need: NeedRouting, task: asyncio.Task[RoutingDecision]) -> None:
        self._task = None
        backlog, self._backlog = self._backlog or [], None
        rest, self._rest = self._rest, []
        decision: RoutingDecision | None = None
        if not task.cancelled():
            if task.exception() is not None:
                logger.error("router failed on request %s", need.request.request_id,
                             exc_info=task.exception())
                decision = ROUTER_ERROR
            else:
                decision = decided(need, task.result())
        if self._gone:
            if decision is not None:  # decided just as the stream went: release it too
                self._stream.routed(decision)
            report_finished(self._router, self._stream.close())
            return
        assert decision is not None  # only on_reset cancels the task
        self._perform(self._stream.routed(decision))
        self._perform(rest)
        for message in backlog:
            self.on_message(message)
        if self._ended and self._task is None:
            self._end()

    def _end(self) -> None:
        report_finished(self._router, self._stream.close())
        self._call.finish()


def _health_service(message: bytes, call: Call) -> str:
    """The service a HealthCheckRequest names; an undecodable one ends `call` (INTERNAL)."""
    try:
        return str(health_pb2.HealthCheckRequest.FromString(message).service)
    except DecodeError:
        call.finish(INTERNAL, "cannot parse a HealthCheckRequest")
        return ""


class HealthCheckCall:
    """`grpc.health.v1.Health/Check` (unary) from `EppServer`'s status table."""

    __slots__ = ("_call", "_service", "_statuses")

    def __init__(self, statuses: dict[str, int], call: Call) -> None:
        self._statuses, self._call, self._service = statuses, call, ""

    def on_message(self, message: bytes) -> None:
        self._service = _health_service(message, self._call)

    def on_end(self) -> None:
        status = self._statuses.get(self._service)
        if status is None:
            self._call.finish(NOT_FOUND, "unknown service")
            return
        self._call.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())
        self._call.finish()

    def on_reset(self) -> None:
        return None


class HealthWatchCall:
    """`grpc.health.v1.Health/Watch` (server streaming) on the h2 transport: the service's
    status once the request is in (SERVICE_UNKNOWN for a service not served, as the protocol
    says, and the watch goes on), then each change, until the client goes or the server stops."""

    __slots__ = ("_call", "_last", "_service", "_statuses", "_watches")

    def __init__(self, statuses: dict[str, int], watches: set[HealthWatchCall], call: Call) -> None:
        self._statuses, self._watches, self._call, self._service = statuses, watches, call, ""
        self._last: int | None = None

    def on_message(self, message: bytes) -> None:
        self._service = _health_service(message, self._call)

    def on_end(self) -> None:
        self._watches.add(self)
        self.update()

    def update(self) -> None:
        """Send the service's status if it changed since the last one sent."""
        status = self._statuses.get(self._service, SERVICE_UNKNOWN)
        if status != self._last:
            self._last = status
            self._call.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())

    def end(self) -> None:
        self._watches.discard(self)
        self._call.finish()

    def on_reset(self) -> None:
        self._watches.discard(self)


class AccessLogCall:
    """`AccessLogService.StreamAccessLogs` (client streaming) on the h2 transport: each
    message's entries go to the router as they arrive; the stream lives as long as the gateway
    keeps it (ended by `end()` when the EPP stops)."""

    __slots__ = ("_call", "_calls", "_open", "_sink")

    def __init__(self, sink: AccessLogSink, calls: set[AccessLogCall], call: Call) -> None:
        self._sink, self._calls, self._call = sink, calls, call
        self._open = True
        calls.add(self)
        sink.access_log_opened()

    def on_message(self, message: bytes) -> None:
        if not take_entries(self._sink, message):
            self._closed()
            self._call.finish(INTERNAL, "cannot parse a StreamAccessLogsMessage")

    def on_end(self) -> None:
        self.end()

    def end(self) -> None:
        if self._open:
            self._closed()
            self._call.send(b"")  # the one (empty) StreamAccessLogsResponse
            self._call.finish()

    def on_reset(self) -> None:
        self._closed()

    def _closed(self) -> None:
        if self._open:
            self._open = False
            self._calls.discard(self)
            self._sink.access_log_closed()
