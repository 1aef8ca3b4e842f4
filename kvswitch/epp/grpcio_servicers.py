"""The EPP's services on grpc.aio, the reference transport (`kvswitch epp --transport grpcio`).

`grpcio_server()` builds the server: `ExtProcServicer` (`ExternalProcessor.Process`, one
`ExtProcStream` per gRPC stream), reflection, and, added by `EppServer`, health and
`AccessLogServicer` (`AccessLogService.StreamAccessLogs`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from kvswitch.epp import access_log
from kvswitch.epp.access_log import AccessLogSink
from kvswitch.epp.contracts import EndpointPicker, RoutingDecision
from kvswitch.epp.extproc import ExtProcStream, NeedRouting
from kvswitch.epp.serving import (
    EXT_PROC_SERVICE,
    ROUTER_ERROR,
    decided,
    report_finished,
    take_entries,
)

logger = logging.getLogger(__name__)


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
        self, request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext
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
                                report_finished(self._router, [routed])
                    else:
                        report_finished(self._router, [action])
        finally:
            # Runs on EOF, on cancellation (Envoy reset the stream) and on write errors alike.
            report_finished(self._router, stream.close())

    async def _route(self, need: NeedRouting) -> RoutingDecision:
        try:
            decision = await self._router.route(need.request, need.subset)
        except Exception:
            logger.exception("router failed on request %s", need.request.request_id)
            return ROUTER_ERROR
        return decided(need, decision)


class AccessLogServicer:
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
                if not take_entries(self._sink, message):
                    await context.abort(grpc.StatusCode.INTERNAL,
                                        "cannot parse a StreamAccessLogsMessage")
        finally:
            self._sink.access_log_closed()
        return b""


def grpcio_server(picker: EndpointPicker, limit: int,
                  options: Sequence[tuple[str, int]] = ()) -> grpc.aio.Server:
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        *options,
    ])
    ExtProcServicer(picker).add_to_server(server)
    reflection.enable_server_reflection(
        (EXT_PROC_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME),
        server,
    )
    return server
