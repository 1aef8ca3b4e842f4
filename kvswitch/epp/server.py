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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvswitch.epp.extproc import Action, ExtProcStream, NeedRouting, RequestFinished
from kvswitch.epp.request import EndpointPicker, RoutingDecision

__all__ = ["EXT_PROC_SERVICE", "HEALTH_SERVICES", "EppServer", "ExtProcServicer"]

logger = logging.getLogger(__name__)

EXT_PROC_SERVICE = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
LIVENESS = "liveness"
READINESS = "readiness"
HEALTH_SERVICES = (LIVENESS, READINESS, EXT_PROC_SERVICE)
_SERVING = health_pb2.HealthCheckResponse.SERVING
# Room for the ext_proc envelope around a body of max_body_bytes.
_ENVELOPE_BYTES = 64 * 1024


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """`ExternalProcessor.Process`: one `ExtProcStream` per gRPC stream."""

    def __init__(self, picker: EndpointPicker) -> None:
        self._picker = picker
        self._router = picker.router

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        stream = ExtProcStream(self._picker)
        try:
            async for message in request_iterator:
                for action in stream.receive(message):
                    if type(action) is ep.ProcessingResponse:
                        yield action
                    elif type(action) is NeedRouting:
                        decision = await self._route(action)
                        for routed in stream.routed(decision):
                            if type(routed) is ep.ProcessingResponse:
                                yield routed
                            else:
                                self._perform_finished([routed])
                    else:
                        self._perform_finished([action])
        finally:
            # Runs on EOF, on cancellation (Envoy reset the stream) and on write errors alike.
            self._perform_finished(stream.close())

    async def _route(self, need: NeedRouting) -> RoutingDecision:
        try:
            decision = await self._router.route(need.request, need.subset)
        except Exception:
            logger.exception("router failed on request %s", need.request.request_id)
            return RoutingDecision(status=503, reason="router-error")
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request %s %s -> %s %s %s", need.request.request_id, need.request.path,
                decision.status, ",".join(decision.endpoints), decision.reason,
            )
        return decision

    def _perform_finished(self, actions: list[Action]) -> None:
        for action in actions:
            if type(action) is not RequestFinished:
                continue
            try:
                self._router.request_finished(action.request, action.outcome)
            except Exception:
                logger.exception("request_finished failed for %s", action.request.request_id)


class EppServer:
    """The EPP's grpc.aio server: `await start()`, then `await stop()` (graceful)."""

    def __init__(self, picker: EndpointPicker, *, host: str = "127.0.0.1", port: int = 9002):
        self.picker = picker
        self.host = host
        self.port = port
        self.health = health_aio.HealthServicer()
        # Headroom over max_body_bytes so that, in BUFFERED mode (one message holds the whole
        # body), a body somewhat over the limit still gets a proper 413 rather than a gRPC error.
        limit = 2 * picker.max_body_bytes + _ENVELOPE_BYTES
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ]
        )
        ep_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(picker), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (EXT_PROC_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            self._server,
        )
        self._started = False

    async def start(self) -> int:
        """Start the router, bind, serve; returns the bound port (useful with port 0)."""
        await self.health.set(LIVENESS, _SERVING)
        await self.picker.router.start()
        self._started = True
        self.port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        if not self.port:
            raise OSError(f"cannot bind the EPP to {self.host}")
        await self._server.start()
        for service in (READINESS, EXT_PROC_SERVICE):
            await self.health.set(service, _SERVING)
        logger.info("endpoint picker listening on %s:%d", self.host, self.port)
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING everywhere, let in-flight streams finish for `grace` s, stop the router."""
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)
        if self._started:
            self._started = False
            await self.picker.router.stop()
        logger.info("endpoint picker stopped")

    async def wait(self) -> None:
        await self._server.wait_for_termination()


async def serve_until(stop: asyncio.Event, server: EppServer, grace: float = 5.0) -> None:
    """Run `server` until `stop` is set, then stop it gracefully."""
    await server.start()
    try:
        await stop.wait()
    finally:
        await server.stop(grace)
