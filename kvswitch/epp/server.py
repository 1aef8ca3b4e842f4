"""The EPP's gRPC server: Envoy's `ExternalProcessor` over `ExtProcStream`, health and reflection.

The servicer is a thin driver: it reads ProcessingRequests, feeds them to a sans-IO
`ExtProcStream`, writes the responses it returns, resolves `NeedRouting` with `router.route()`
and hands `RequestFinished` to `router.request_finished()`. When the stream ends for any reason
(end of request, client cancel, upstream reset -- Envoy closes or cancels the ext_proc stream)
`ExtProcStream.close()` reports a routed request that has not finished yet, exactly once.

Health (`grpc.health.v1`): `liveness` is SERVING while the process runs; `readiness` and
`envoy.service.ext_proc.v3.ExternalProcessor` become SERVING once the router has started and the
port is bound, and NOT_SERVING at shutdown. Readiness deliberately does not depend on the pool
having ready endpoints: with none, the EPP still answers every request correctly (503 with a
dropped reason, gRPC UNAVAILABLE), which is more useful to clients than a proxy failing to
reach its ext_proc server (Envoy then fails requests with a bare 500 or skips the EPP).

Two transports serve the same streams (`EppServer(transport=...)`, `kvswitch epp --transport`):
- `h2` (default): `kvswitch.epp.h2server`, a lean asyncio HTTP/2 gRPC server; `_ProcessCall`
  drives `ExtProcStream` straight from its frames. `router.route()` is stepped eagerly: only a
  request that really waits (flow control queued it) gets a task; messages that arrive
  meanwhile wait behind it, in order. Health Check and Watch; no reflection.
- `grpcio`: grpc.aio with `ExtProcServicer`, health (Check and Watch) and reflection.
"""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import AsyncIterator, Coroutine, Generator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvswitch.epp import access_log
from kvswitch.epp.access_log import AccessLogSink
from kvswitch.epp.extproc import Action, ExtProcStream, NeedRouting, RequestFinished
from kvswitch.epp.h2server import INTERNAL, NOT_FOUND, Call, H2GrpcServer, HandlerFactory
from kvswitch.epp.request import EndpointPicker, Router, RoutingDecision
from kvswitch.tls import TlsFiles, grpc_server_credentials, server_ssl_context

__all__ = ["EXT_PROC_SERVICE", "HEALTH_SERVICES", "TRANSPORTS", "EppServer", "ExtProcServicer"]

logger = logging.getLogger(__name__)

EXT_PROC_SERVICE = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
LIVENESS = "liveness"
READINESS = "readiness"
HEALTH_SERVICES = (LIVENESS, READINESS, EXT_PROC_SERVICE)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROCESS_PATH = f"/{EXT_PROC_SERVICE}/Process"
HEALTH_CHECK_PATH = "/grpc.health.v1.Health/Check"
HEALTH_WATCH_PATH = "/grpc.health.v1.Health/Watch"
_SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
TRANSPORTS = ("h2", "grpcio")
_ROUTER_ERROR = RoutingDecision(status=503, reason="router-error")
# Room for the ext_proc envelope around a body of max_body_bytes.
_ENVELOPE_BYTES = 64 * 1024


def _decided(need: NeedRouting, decision: RoutingDecision) -> RoutingDecision:
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "request %s %s -> %s %s %s", need.request.request_id, need.request.path,
            decision.status, ",".join(decision.endpoints), decision.reason,
        )
    return decision


def _report_finished(router: Router, actions: list[Action]) -> None:
    for action in actions:
        if type(action) is not RequestFinished:
            continue
        try:
            router.request_finished(action.request, action.outcome)
        except Exception:
            logger.exception("request_finished failed for %s", action.request.request_id)


class ExtProcServicer:
    """`ExternalProcessor.Process` on grpc.aio: one `ExtProcStream` per gRPC stream. It yields
    serialized ProcessingResponses: register it with `add_to_server()` (no response
    serializer), not the generated `add_ExternalProcessorServicer_to_server`."""

    def __init__(self, picker: EndpointPicker) -> None:
        self._picker = picker
        self._router = picker.router

    def add_to_server(self, server: grpc.aio.Server) -> None:
        process = grpc.stream_stream_rpc_method_handler(
            self.Process, request_deserializer=ep.ProcessingRequest.FromString)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": process}),))

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        stream = ExtProcStream(self._picker)
        try:
            async for message in request_iterator:
                for action in stream.receive(message):
                    if type(action) is bytes:
                        yield action
                    elif type(action) is NeedRouting:
                        decision = await self._route(action)
                        for routed in stream.routed(decision):
                            if type(routed) is bytes:
                                yield routed
                            else:
                                _report_finished(self._router, [routed])
                    else:
                        _report_finished(self._router, [action])
        finally:
            # Runs on EOF, on cancellation (Envoy reset the stream) and on write errors alike.
            _report_finished(self._router, stream.close())

    async def _route(self, need: NeedRouting) -> RoutingDecision:
        try:
            decision = await self._router.route(need.request, need.subset)
        except Exception:
            logger.exception("router failed on request %s", need.request.request_id)
            return _ROUTER_ERROR
        return _decided(need, decision)


# -- the h2 transport --------------------------------------------------------------------------


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


async def _finish_route(coro: Coroutine[Any, Any, RoutingDecision], yielded: Any) -> RoutingDecision:
    decision: RoutingDecision = await _resume(coro, yielded)
    return decision


def _start_route(router: Router, need: NeedRouting) -> RoutingDecision | asyncio.Task[RoutingDecision]:
    """The decision if `route()` finishes without waiting (the usual case), else a task."""
    coro = router.route(need.request, need.subset)
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        decision: RoutingDecision = stop.value
        return decision
    return asyncio.get_running_loop().create_task(_finish_route(coro, yielded))


class _ProcessCall:
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
            _report_finished(self._router, self._stream.close())
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
            _report_finished(self._router, self._stream.close())

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
                _report_finished(self._router, [action])

    def _route(self, need: NeedRouting, rest: list[Action]) -> bool:
        """True if routed now; False if a task will finish it (and then `rest`)."""
        try:
            pending = _start_route(self._router, need)
        except Exception:
            logger.exception("router failed on request %s", need.request.request_id)
            pending = _ROUTER_ERROR
        if isinstance(pending, RoutingDecision):
            self._perform(self._stream.routed(_decided(need, pending)))
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
                decision = _ROUTER_ERROR
            else:
                decision = _decided(need, task.result())
        if self._gone:
            if decision is not None:  # decided just as the stream went: release it too
                self._stream.routed(decision)
            _report_finished(self._router, self._stream.close())
            return
        assert decision is not None  # only on_reset cancels the task
        self._perform(self._stream.routed(decision))
        self._perform(rest)
        for message in backlog:
            self.on_message(message)
        if self._ended and self._task is None:
            self._end()

    def _end(self) -> None:
        _report_finished(self._router, self._stream.close())
        self._call.finish()


def _health_service(message: bytes, call: Call) -> str:
    """The service a HealthCheckRequest names; an undecodable one ends `call` (INTERNAL)."""
    try:
        return str(health_pb2.HealthCheckRequest.FromString(message).service)
    except DecodeError:
        call.finish(INTERNAL, "cannot parse a HealthCheckRequest")
        return ""


class _HealthCheckCall:
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


class _HealthWatchCall:
    """`grpc.health.v1.Health/Watch` (server streaming) on the h2 transport: the service's
    status once the request is in (SERVICE_UNKNOWN for a service not served, as the protocol
    says, and the watch goes on), then each change, until the client goes or the server stops."""

    __slots__ = ("_call", "_last", "_service", "_statuses", "_watches")

    def __init__(self, statuses: dict[str, int], watches: set[_HealthWatchCall], call: Call) -> None:
        self._statuses, self._watches, self._call, self._service = statuses, watches, call, ""
        self._last: int | None = None

    def on_message(self, message: bytes) -> None:
        self._service = _health_service(message, self._call)

    def on_end(self) -> None:
        self._watches.add(self)
        self.update()

    def update(self) -> None:
        """Send the service's status if it changed since the last one sent."""
        status = self._statuses.get(self._service, _SERVICE_UNKNOWN)
        if status != self._last:
            self._last = status
            self._call.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())

    def end(self) -> None:
        self._watches.discard(self)
        self._call.finish()

    def on_reset(self) -> None:
        self._watches.discard(self)


def _take_entries(sink: AccessLogSink, message: bytes) -> bool:
    """Feed one StreamAccessLogsMessage to `sink`; False if it does not parse."""
    try:
        ends = access_log.ended_requests(message)
    except DecodeError:
        return False
    for end in ends:
        try:
            sink.request_logged(end)
        except Exception:  # a bug costs that entry, not the gateway's log stream
            logger.exception("access-log entry of request %s failed", end.request_id)
    return True


class _AccessLogCall:
    """`AccessLogService.StreamAccessLogs` (client streaming) on the h2 transport: each
    message's entries go to the router as they arrive; the stream lives as long as the gateway
    keeps it (ended by `end()` when the EPP stops)."""

    __slots__ = ("_call", "_calls", "_open", "_sink")

    def __init__(self, sink: AccessLogSink, calls: set[_AccessLogCall], call: Call) -> None:
        self._sink, self._calls, self._call = sink, calls, call
        self._open = True
        calls.add(self)
        sink.access_log_opened()

    def on_message(self, message: bytes) -> None:
        if not _take_entries(self._sink, message):
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


class _AccessLogServicer:
    """`AccessLogService.StreamAccessLogs` on the grpcio transport."""

    def __init__(self, sink: AccessLogSink) -> None:
        self._sink = sink

    def add_to_server(self, server: grpc.aio.Server) -> None:
        handler = grpc.stream_unary_rpc_method_handler(
            self.StreamAccessLogs, response_serializer=bytes)
        service, method = access_log.SERVICE_PATH[1:].split("/")
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),))

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[bytes],
                               context: grpc.aio.ServicerContext) -> bytes:
        self._sink.access_log_opened()
        try:
            async for message in request_iterator:
                if not _take_entries(self._sink, message):
                    await context.abort(grpc.StatusCode.INTERNAL,
                                        "cannot parse a StreamAccessLogsMessage")
        finally:
            self._sink.access_log_closed()
        return b""


class EppServer:
    """The EPP's gRPC server: `await start()`, then `await stop()` (graceful).

    `transport`: "h2" (default; `kvswitch.epp.h2server`, health Check and Watch) or "grpcio"
    (grpc.aio, with health Check and Watch and reflection)."""

    def __init__(self, picker: EndpointPicker, *, host: str = "127.0.0.1", port: int = 9002,
                 transport: str = "h2", tls: TlsFiles | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}: {transport!r}")
        self.picker = picker
        self.host = host
        self.port = port
        self.transport = transport
        self.tls = tls
        # "" is the server as a whole, as grpcio's HealthServicer has it.
        self._health: dict[str, int] = {"": _SERVING}
        self._shutting_down = False
        # Headroom over max_body_bytes so that, in BUFFERED mode (one message holds the whole
        # body), a body somewhat over the limit still gets a proper 413 rather than a gRPC error.
        limit = 2 * picker.max_body_bytes + _ENVELOPE_BYTES
        self._h2: H2GrpcServer | None = None
        self._watches: set[_HealthWatchCall] = set()
        self._grpc: grpc.aio.Server | None = None
        self._grpc_health: health_aio.HealthServicer | None = None
        self._access_logs: set[_AccessLogCall] = set()
        # The gateway's access log finishes requests whose response the EPP is not shown.
        sink = picker.router if isinstance(picker.router, AccessLogSink) else None
        if transport == "h2":
            handlers: dict[str, HandlerFactory] = {
                PROCESS_PATH: lambda call: _ProcessCall(picker, call),
                HEALTH_CHECK_PATH: lambda call: _HealthCheckCall(self._health, call),
                HEALTH_WATCH_PATH: lambda call: _HealthWatchCall(self._health, self._watches, call),
            }
            if sink is not None:
                handlers[access_log.SERVICE_PATH] = lambda call: self._access_log(sink, call)
            self._h2 = H2GrpcServer(handlers, host=host, port=port, max_message_bytes=limit,
                                    ssl=server_ssl_context(tls) if tls is not None else None)
        else:
            self._grpc, self._grpc_health = _grpcio_server(picker, limit), health_aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self._grpc_health, self._grpc)
            if sink is not None:
                _AccessLogServicer(sink).add_to_server(self._grpc)
        self._started = False

    def _access_log(self, sink: AccessLogSink, call: Call) -> _AccessLogCall:
        handler = _AccessLogCall(sink, self._access_logs, call)
        if self._shutting_down:  # a draining EPP takes no new log stream: it would hold the drain
            handler.end()
        return handler

    def health_status(self, service: str) -> int | None:
        """The `grpc.health.v1` status served for `service` (None: unknown service)."""
        return self._health.get(service)

    async def _set_health(self, service: str, status: int) -> None:
        if self._shutting_down:
            return
        self._health[service] = status
        for watch in list(self._watches):
            watch.update()
        if self._grpc_health is not None:
            await self._grpc_health.set(service, status)

    async def start(self) -> int:
        """Start the router, bind, serve; returns the bound port (useful with port 0)."""
        await self._set_health(LIVENESS, _SERVING)
        await self.picker.router.start()
        self._started = True
        if self._h2 is not None:
            self.port = await self._h2.start()
        else:
            assert self._grpc is not None
            address = f"{self.host}:{self.port}"
            self.port = (self._grpc.add_secure_port(address, grpc_server_credentials(self.tls))
                         if self.tls is not None else self._grpc.add_insecure_port(address))
            if not self.port:
                raise OSError(f"cannot bind the EPP to {self.host}")
            await self._grpc.start()
        for service in (READINESS, EXT_PROC_SERVICE):
            await self._set_health(service, _SERVING)
        logger.info("endpoint picker listening on %s:%d (%s)", self.host, self.port,
                    self.transport)
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING everywhere, let in-flight streams finish for `grace` s, stop the router."""
        self._shutting_down = True
        for service in self._health:
            self._health[service] = _NOT_SERVING
        for watch in list(self._watches):  # NOT_SERVING, then end: a watch must not hold the drain
            watch.update()
            watch.end()
        for log_stream in list(self._access_logs):  # nor a gateway's access-log stream
            log_stream.end()
        if self._h2 is not None:
            await self._h2.stop(grace)
        else:
            assert self._grpc is not None and self._grpc_health is not None
            await self._grpc_health.enter_graceful_shutdown()
            await self._grpc.stop(grace)
        if self._started:
            self._started = False
            await self.picker.router.stop()
        logger.info("endpoint picker stopped")

    async def wait(self) -> None:
        if self._h2 is not None:
            await self._h2.wait()
        else:
            assert self._grpc is not None
            await self._grpc.wait_for_termination()


def _grpcio_server(picker: EndpointPicker, limit: int) -> grpc.aio.Server:
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
    ])
    ExtProcServicer(picker).add_to_server(server)
    reflection.enable_server_reflection(
        (EXT_PROC_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME),
        server,
    )
    return server


async def serve_until(stop: asyncio.Event, server: EppServer, grace: float = 5.0) -> None:
    """Run `server` until `stop` is set, then stop it gracefully."""
    await server.start()
    try:
        await stop.wait()
    finally:
        await server.stop(grace)
