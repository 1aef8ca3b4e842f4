"""Registers an engine servicer (VllmEngine or SglangScheduler) with a grpc.aio server, its
handlers reading the requests.

grpcio parses a request before the handler runs, and a parse error there can only end the call
as UNKNOWN ("Unexpected DecodeError"). And when a unary request's body ends inside a message (a
length prefix longer than what follows it), grpc core never completes the read, so a unary
handler never runs and the call hangs. Here every handler is registered as request-streaming:
it reads the request's raw bytes itself (grpc core ends that stream at the body's end, dropping a
partial message) and parses them, so a request that does not decode, or has no whole message,
ends its call with INVALID_ARGUMENT. The handler table is the generated one
(`add_VllmEngineServicer_to_server` or `add_SglangSchedulerServicer_to_server`), so every RPC the
service defines is covered.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvswitch.errors import InvalidRequest
from kvswitch.protocol import SERVICE_NAME, vllm_engine_pb2_grpc
from kvswitch.protocol.sglang import SGLANG_SERVICE_NAME, sglang_scheduler_pb2_grpc

__all__ = ["add_engine_servicer"]

logger = logging.getLogger(__name__)

_Parse = Callable[[bytes], Any]


def add_engine_servicer(servicer: object, server: grpc.aio.Server) -> str:
    """`add_VllmEngineServicer_to_server` (or SGLang's, for a `SglangSchedulerServicer`), with
    undecodable requests INVALID_ARGUMENT; returns the service's name."""
    table = _HandlerTable()
    if isinstance(servicer, sglang_scheduler_pb2_grpc.SglangSchedulerServicer):
        service = SGLANG_SERVICE_NAME
        sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(servicer, table)
    else:
        service = SERVICE_NAME
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, table)
    handlers = {method: _parsing_handler(method, handler)
                for method, handler in table.handlers.items()}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
    return service


class _HandlerTable:
    """Stands in for a server to collect the handlers the generated code registers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, generic_handlers: object) -> None:
        pass  # the same handlers, also given to add_registered_method_handlers

    def add_registered_method_handlers(self, service_name: str,
                                       handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers.update(handlers)


def _parsing_handler(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same RPC, request-streaming on the wire with no deserializer: its behaviour reads
    and parses the one request message first."""
    if handler.request_streaming:  # neither service has one
        raise TypeError(f"{method}: request-streaming RPCs are not supported")
    parse = handler.request_deserializer
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            _parse_then_stream(method, parse, handler.unary_stream),
            response_serializer=handler.response_serializer)
    return grpc.stream_unary_rpc_method_handler(
        _parse_then_call(method, parse, handler.unary_unary),
        response_serializer=handler.response_serializer)


def _parse_then_call(method: str, parse: _Parse,
                     behaviour: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
                     ) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext],
                                   Awaitable[Any]]:
    async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        request = await _read_request(method, parse, requests, context)
        return await behaviour(request, context)

    return handle


def _parse_then_stream(method: str, parse: _Parse,
                       behaviour: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]
                       ) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext],
                                     Awaitable[None]]:
    # A coroutine that writes each message, not a generator re-yielding them: grpc.aio's own
    # loop over a generator handler makes the same writes, so no message costs more.
    async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        request = await _read_request(method, parse, requests, context)
        async for message in behaviour(request, context):
            await context.write(message)

    return handle


async def _read_request(method: str, parse: _Parse, requests: AsyncIterator[bytes],
                        context: grpc.aio.ServicerContext) -> Any:
    """The call's one request, parsed; INVALID_ARGUMENT (context.abort raises) when the body
    holds no whole message or the message does not decode. Only the first message is read, as
    a unary handler reads it."""
    async for raw in requests:
        try:
            return parse(raw)
        except DecodeError as exc:
            logger.info("%s request refused: %s", method, exc)
            await context.abort(InvalidRequest.grpc_code,
                                f"The {method} request could not be parsed: {exc}")
    logger.info("%s request refused: no whole message", method)
    await context.abort(InvalidRequest.grpc_code,
                        f"The {method} request holds no whole message (a gRPC frame's length "
                        "prefix is longer than the body that follows it)")
