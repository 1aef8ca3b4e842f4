"""ext_proc messages as Envoy sends them, the replies the EPP gives, and a sans-IO stream to
feed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.struct_pb2 import Struct

from kvswitch.epp.contracts import EndpointPicker, RoutingDecision
from kvswitch.epp.extproc import ExtProcStream, NeedRouting
from kvswitch.epp.parsers import default_parsers
from kvswitch.epp.parsers.passthrough import PassthroughParser
from kvswitch.protocol import GENERATE_PATH, vllm_engine_pb2
from kvswitch.protocol.grpc_framing import encode


class NeverRouter:
    """ExtProcStream never calls the router: the driver does. Present only to fill the picker."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def route(self, request: object, subset: object) -> RoutingDecision:
        raise AssertionError("sans-IO stream must not route")
    def request_finished(self, request: object, outcome: object) -> None:
        raise AssertionError("sans-IO stream must not call request_finished")


def decoded(actions: list[Any]) -> list[Any]:
    """Serialized replies read back as ProcessingResponse messages, to compare them whole."""
    return [ep.ProcessingResponse.FromString(a) if type(a) is bytes else a for a in actions]


class ReadableStream(ExtProcStream):
    """The stream under test with its replies decoded (`decoded`)."""

    def receive(self, message: ep.ProcessingRequest) -> list[Any]:
        return decoded(super().receive(message))

    def routed(self, decision: RoutingDecision) -> list[Any]:
        return decoded(super().routed(decision))


def make_stream(*, passthrough: bool = False, max_body_bytes: int = 1 << 20) -> ExtProcStream:
    parsers = [*default_parsers(), *([PassthroughParser()] if passthrough else [])]
    picker = EndpointPicker(parsers=parsers, router=NeverRouter(), max_body_bytes=max_body_bytes)
    return ReadableStream(picker, clock=lambda: 42.0)


def header_map(pairs: Sequence[tuple[str, str]]) -> HeaderMap:
    return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


def grpc_headers(*extra: tuple[str, str], path: str = GENERATE_PATH, eos: bool = False,
                 mode: int | None = None, metadata: Metadata | None = None) -> ep.ProcessingRequest:
    pairs = [(":method", "POST"), (":path", path), (":authority", "gw"),
             ("content-type", "application/grpc"), ("te", "trailers"), *extra]
    request = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=header_map(pairs), end_of_stream=eos))
    if mode is not None:
        request.protocol_config.request_body_mode = mode  # type: ignore[assignment]
    if metadata is not None:
        request.metadata_context.CopyFrom(metadata)
    return request


def http_headers(path: str, *extra: tuple[str, str], eos: bool = False) -> ep.ProcessingRequest:
    pairs = [(":method", "POST" if not eos else "GET"), (":path", path),
             ("content-type", "application/json"), *extra]
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=header_map(pairs), end_of_stream=eos))


def body(data: bytes, eos: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=eos))


def response_headers(*pairs: tuple[str, str], eos: bool = False) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(headers=header_map(pairs), end_of_stream=eos))


def response_trailers(*pairs: tuple[str, str]) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_trailers=ep.HttpTrailers(trailers=header_map(pairs)))


TOKENS = list(range(1000, 1100))


GENERATE = encode(vllm_engine_pb2.GenerateRequest(
    request_id="body-id", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=TOKENS),
    sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=16), stream=True,
).SerializeToString())


def overwrite(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()),
                             append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def destination_headers_reply(destination: str, *, grpc: bool = True) -> ep.ProcessingResponse:
    sets = [overwrite("x-gateway-destination-endpoint", destination)]
    if grpc:
        sets.append(overwrite("te", "trailers"))
    metadata = Struct()
    metadata.update({"envoy.lb": {"x-gateway-destination-endpoint": destination}})
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=sets))),
        dynamic_metadata=metadata)


def route_generate(stream: ExtProcStream, *extra: tuple[str, str]) -> NeedRouting:
    assert stream.receive(grpc_headers(*extra)) == []  # full duplex: the headers reply is held
    assert stream.receive(body(GENERATE[:7], eos=False)) == []
    [need] = stream.receive(body(GENERATE[7:], eos=True))
    assert isinstance(need, NeedRouting)
    return need
