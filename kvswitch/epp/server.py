"""The EPP's gRPC server: Envoy's `ExternalProcessor` over `ExtProcStream`, health and reflection.

Each transport's Process handler is a thin driver: it reads ProcessingRequests, feeds them to a
sans-IO `ExtProcStream`, writes the responses it returns, resolves `NeedRouting` with
`router.route()` and hands `RequestFinished` to `router.request_finished()`. When the stream ends
for any reason (end of request, client cancel, upstream reset -- Envoy closes or cancels the
ext_proc stream) `ExtProcStream.close()` reports a routed request that has not finished yet,
exactly once.

Health (`grpc.health.v1`): `liveness` is SERVING while the process runs; `readiness` and
`envoy.service.ext_proc.v3.ExternalProcessor` become SERVING once the router has started and the
port is bound, and NOT_SERVING at shutdown. Readiness deliberately does not depend on the pool
having ready endpoints: with none, the EPP still answers every request correctly (503 with a
dropped reason, gRPC UNAVAILABLE), which is more useful to clients than a proxy failing to
reach its ext_proc server (Envoy then fails requests with a bare 500 or skips the EPP).
A discovery that reports health (`add_health_listener`, Kubernetes discovery) does gate
readiness: while it cannot read the pool (RBAC forbids it, the pool is missing) the EPP is not
ready, so Kubernetes and gateways see it.

Two transports serve the same streams (`EppServer(transport=...)`, `kvswitch epp --transport`):
- `h2` (default): `kvswitch.epp.h2server`, a lean asyncio HTTP/2 gRPC server, with the stream
  handlers of `kvswitch.epp.h2_handlers`. Health Check and Watch; no reflection.
- `grpcio`: grpc.aio with `kvswitch.epp.grpcio_servicers`, health (Check and Watch) and
  reflection. It is kept as the reference: the server tests run every behaviour on both
  transports, so grpc.aio is the oracle for the lean one, and it serves reflection for grpcurl;
  it costs about three times the CPU per request (docs/benchmarks/transports.md).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvswitch.epp import access_log
from kvswitch.epp.access_log import AccessLogSink
from kvswitch.epp.contracts import EndpointPicker
from kvswitch.epp.datalayer.discovery import ReportsHealth
from kvswitch.epp.grpcio_servicers import AccessLogServicer, grpcio_server
from kvswitch.epp.h2_handlers import AccessLogCall, HealthCheckCall, HealthWatchCall, ProcessCall
from kvswitch.epp.h2server import Call, H2GrpcServer, HandlerFactory
from kvswitch.epp.serving import (
    EXT_PROC_SERVICE,
    HEALTH_CHECK_PATH,
    HEALTH_SERVICES,
    HEALTH_WATCH_PATH,
    LIVENESS,
    NOT_SERVING,
    PROCESS_PATH,
    READINESS,
    SERVING,
)
from kvswitch.tls import (
    TlsFiles,
    grpc_server_credentials,
    grpc_server_options,
    server_ssl_context,
)

__all__ = ["EXT_PROC_SERVICE", "HEALTH_SERVICES", "PROCESS_PATH", "TRANSPORTS", "EppServer"]

logger = logging.getLogger(__name__)

TRANSPORTS = ("h2", "grpcio")
# Room for the ext_proc envelope around a body of max_body_bytes.
_ENVELOPE_BYTES = 64 * 1024


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
        self._health: dict[str, int] = {"": SERVING}
        self._shutting_down = False
        # Headroom over max_body_bytes so that, in BUFFERED mode (one message holds the whole
        # body), a body somewhat over the limit still gets a proper 413 rather than a gRPC error.
        limit = 2 * picker.max_body_bytes + _ENVELOPE_BYTES
        self._h2: H2GrpcServer | None = None
        self._watches: set[HealthWatchCall] = set()
        self._grpc: grpc.aio.Server | None = None
        self._grpc_health: health_aio.HealthServicer | None = None
        self._access_logs: set[AccessLogCall] = set()
        # The gateway's access log finishes requests whose response the EPP is not shown.
        sink = picker.router if isinstance(picker.router, AccessLogSink) else None
        if transport == "h2":
            handlers: dict[str, HandlerFactory] = {
                PROCESS_PATH: lambda call: ProcessCall(picker, call),
                HEALTH_CHECK_PATH: lambda call: HealthCheckCall(self._health, call),
                HEALTH_WATCH_PATH: lambda call: HealthWatchCall(self._health, self._watches, call),
            }
            if sink is not None:
                handlers[access_log.SERVICE_PATH] = lambda call: self._access_log(sink, call)
            self._h2 = H2GrpcServer(handlers, host=host, port=port, max_message_bytes=limit,
                                    ssl=server_ssl_context(tls) if tls is not None else None,
                                    ssl_handshake_timeout=tls.handshake_timeout if tls else None)
        else:
            self._grpc = grpcio_server(picker, limit, grpc_server_options(tls))
            self._grpc_health = health_aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self._grpc_health, self._grpc)
            if sink is not None:
                AccessLogServicer(sink).add_to_server(self._grpc)
        self._started = False
        self._serving = False
        self._discovery_ready = True
        self._health_tasks: set[asyncio.Task[None]] = set()

    def _discovery_health(self, ready: bool, problem: str) -> None:
        self._discovery_ready = ready
        if self._serving:
            task = asyncio.get_running_loop().create_task(self._set_readiness())
            self._health_tasks.add(task)
            task.add_done_callback(self._health_tasks.discard)

    async def _set_readiness(self) -> None:
        status = SERVING if self._discovery_ready else NOT_SERVING
        for service in (READINESS, EXT_PROC_SERVICE):
            await self._set_health(service, status)

    def _access_log(self, sink: AccessLogSink, call: Call) -> AccessLogCall:
        handler = AccessLogCall(sink, self._access_logs, call)
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
        await self._set_health(LIVENESS, SERVING)
        discovery = getattr(getattr(self.picker.router, "refresher", None), "discovery", None)
        if isinstance(discovery, ReportsHealth):
            discovery.add_health_listener(self._discovery_health)
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
        self._serving = True
        await self._set_readiness()
        logger.info("endpoint picker listening on %s:%d (%s)", self.host, self.port,
                    self.transport)
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING everywhere, let in-flight streams finish for `grace` s, stop the router."""
        self._shutting_down = True
        for service in self._health:
            self._health[service] = NOT_SERVING
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


async def serve_until(stop: asyncio.Event, server: EppServer, grace: float = 5.0) -> None:
    """Run `server` until `stop` is set, then stop it gracefully."""
    await server.start()
    try:
        await stop.wait()
    finally:
        await server.stop(grace)
