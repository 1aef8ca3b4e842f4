"""The sans-IO ext_proc stream: exact ProcessingRequests in, exact actions out, no network."""

from __future__ import annotations

import gzip

import orjson
import pytest
from envoy.config.core.v3.base_pb2 import Metadata
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import ListValue, Value

from kvswitch.epp.contracts import ParsedBody, RequestOutcome, RoutingDecision
from kvswitch.epp.extproc import ExtProcStream, NeedRouting, RequestFinished
from kvswitch.protocol import GENERATE_PATH, method_path, vllm_engine_pb2
from kvswitch.protocol.grpc_framing import encode
from tests.support.extproc import (
    GENERATE,
    TOKENS,
    body,
    destination_headers_reply,
    grpc_headers,
    http_headers,
    make_stream,
    overwrite,
    response_headers,
    response_trailers,
    route_generate,
)


def echo(data: bytes, eos: bool = True) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
        body_mutation=ep.BodyMutation(
            streamed_response=ep.StreamedBodyResponse(body=data, end_of_stream=eos)))))


RESPONSE_HEADERS_OK = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
RESPONSE_TRAILERS_OK = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


# -- the full-duplex request path ----------------------------------------------------------------


def test_generate_full_duplex_round_trip() -> None:
    stream = make_stream()
    need = route_generate(stream, ("x-request-id", "rid-1"))
    assert need.subset is None
    request = need.request
    assert request.request_id == "rid-1"
    assert (request.protocol, request.path, request.body_size, request.received_at) == (
        "grpc", GENERATE_PATH, len(GENERATE), 42.0)
    assert request.body == ParsedBody(prompt_token_ids=tuple(TOKENS), stream=True, max_tokens=16,
                                      request_id="body-id")
    assert (request.objective, request.fairness_id) == (None, "default-flow")

    out = stream.routed(RoutingDecision(endpoints=("10.0.0.1:8000", "10.0.0.2:8000")))
    assert out == [destination_headers_reply("10.0.0.1:8000,10.0.0.2:8000"), echo(GENERATE)]

    assert stream.receive(response_headers((":status", "200"),
                                           ("content-type", "application/grpc"))) == [
        RESPONSE_HEADERS_OK]
    out = stream.receive(response_trailers(
        ("grpc-status", "0"),
        ("x-kvswitch-usage", "prompt_tokens=100;completion_tokens=16;cached_tokens=64")))
    assert out == [RESPONSE_TRAILERS_OK, RequestFinished(request, RequestOutcome(
        endpoint="10.0.0.1:8000", ok=True, grpc_status=0, http_status=200,
        prompt_tokens=100, completion_tokens=16, cached_tokens=64))]
    assert stream.close() == []  # finished exactly once


def test_request_id_falls_back_to_the_body_then_a_fresh_one() -> None:
    assert route_generate(make_stream()).request.request_id == "body-id"
    stream = make_stream()
    stream.receive(http_headers("/v1/completions"))
    [need] = stream.receive(body(b'{"prompt": "x"}', eos=True))
    assert isinstance(need, NeedRouting) and len(need.request.request_id) == 32


def test_spoofed_destination_header_is_overwritten_and_hidden_from_the_router() -> None:
    stream = make_stream()
    need = route_generate(stream, ("x-gateway-destination-endpoint", "6.6.6.6:1"))
    assert "x-gateway-destination-endpoint" not in need.request.headers
    [headers_reply, _] = stream.routed(RoutingDecision(endpoints=("10.0.0.1:8000",)))
    [dest, _te] = headers_reply.request_headers.response.header_mutation.set_headers
    assert dest == overwrite("x-gateway-destination-endpoint", "10.0.0.1:8000")


def test_llm_d_headers_and_their_aliases() -> None:
    need = route_generate(make_stream(), ("x-gateway-inference-objective", "old"),
                          ("x-llm-d-inference-objective", "chat"),
                          ("x-gateway-inference-fairness-id", "tenant-a"),
                          ("x-llm-d-slo-ttft-ms", "250"), ("x-gateway-slo-tpot-ms", "20.5"))
    r = need.request
    assert (r.objective, r.fairness_id, r.slo_ttft_ms, r.slo_tpot_ms) == (
        "chat", "tenant-a", 250.0, 20.5)


def test_the_model_label_comes_from_the_body_else_the_model_name_header() -> None:
    # A gRPC body names no model: the header does (kvswitch's frontend sends it).
    need = route_generate(make_stream(), ("x-gateway-model-name", "Qwen/Qwen3-0.6B"))
    assert need.request.model == "Qwen/Qwen3-0.6B"
    assert route_generate(make_stream()).request.model == ""
    stream = make_stream()
    stream.receive(http_headers("/v1/completions", ("x-gateway-model-name", "other")))
    [need] = stream.receive(body(b'{"model": "from-body", "prompt": "x"}', eos=True))
    assert isinstance(need, NeedRouting) and need.request.model == "from-body"


# -- subset hint ---------------------------------------------------------------------------------


def subset_metadata(value: Value) -> Metadata:
    metadata = Metadata()
    metadata.filter_metadata["envoy.lb.subset_hint"].fields[
        "x-gateway-destination-endpoint-subset"].CopyFrom(value)
    return metadata


def test_subset_hint_from_filter_metadata() -> None:
    hint = Value(list_value=ListValue(values=[Value(string_value="10.0.0.2:8000"),
                                              Value(string_value="10.0.0.3:8000")]))
    stream = make_stream()
    stream.receive(grpc_headers(metadata=subset_metadata(hint)))
    [need] = stream.receive(body(GENERATE, eos=True))
    assert isinstance(need, NeedRouting)
    assert need.subset == ("10.0.0.2:8000", "10.0.0.3:8000")


def test_subset_hint_from_header() -> None:
    stream = make_stream()
    stream.receive(grpc_headers(("x-gateway-destination-endpoint-subset", "a:1, b:2")))
    [need] = stream.receive(body(GENERATE, eos=True))
    assert isinstance(need, NeedRouting) and need.subset == ("a:1", "b:2")


def test_empty_subset_hint_is_503_without_routing() -> None:
    stream = make_stream()
    stream.receive(grpc_headers(metadata=subset_metadata(Value(list_value=ListValue()))))
    [reply] = stream.receive(body(GENERATE, eos=True))
    assert reply == grpc_error(14, "subset hint lists no endpoints",
                               "subset hint lists no endpoints")


# -- errors --------------------------------------------------------------------------------------


def grpc_error(code: int, message: str, reason: str) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=HttpStatus(code=200),  # type: ignore[arg-type]
        headers=ep.HeaderMutation(set_headers=[
            overwrite("content-type", "application/grpc"),
            overwrite("grpc-status", str(code)),
            overwrite("grpc-message", message),
            overwrite("x-llm-d-request-dropped-reason", reason),
        ]),
        grpc_status=ep.GrpcStatus(status=code)))


def http_error(status: int, message: str, reason: str, error_type: str,
               param: str | None = None) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=HttpStatus(code=status),  # type: ignore[arg-type]
        headers=ep.HeaderMutation(set_headers=[
            overwrite("content-type", "application/json"),
            overwrite("x-llm-d-request-dropped-reason", reason),
        ]),
        body=orjson.dumps({"error": {"message": message, "type": error_type, "param": param,
                                     "code": status}})))


@pytest.mark.parametrize(
    ("status", "code", "error_type"),
    [(503, 14, "ServiceUnavailableError"), (429, 8, "RateLimitError")],
)
def test_router_refusals_for_grpc_and_http(status: int, code: int, error_type: str) -> None:
    stream = make_stream()
    route_generate(stream)
    decision = RoutingDecision(status=status, reason="pool saturated")
    assert stream.routed(decision) == [grpc_error(code, "pool saturated", "pool saturated")]
    assert stream.close() == []  # never routed: nothing to finish

    stream = make_stream()
    stream.receive(http_headers("/v1/completions"))
    stream.receive(body(b'{"prompt": "x"}', eos=True))
    assert stream.routed(decision) == [
        http_error(status, "pool saturated", "pool saturated", error_type)]


def test_malformed_json_is_400_with_openai_error_body() -> None:
    stream = make_stream()
    stream.receive(http_headers("/v1/chat/completions"))
    [reply] = stream.receive(body(b'{"messages": 3}', eos=True))
    assert reply == http_error(400, "'messages' must be a non-empty list", "InvalidRequest",
                               "BadRequestError", param="messages")
    assert stream.receive(response_headers((":status", "400"))) == []  # stream is done


def test_truncated_grpc_frame_is_invalid_argument() -> None:
    stream = make_stream()
    stream.receive(grpc_headers())
    [reply] = stream.receive(body(GENERATE[:-3], eos=True))
    assert reply == grpc_error(
        3, f"truncated gRPC message: body ends {len(GENERATE) - 3} bytes into a frame",
        "InvalidRequest")


def test_gzip_frames_are_routed_and_echoed_compressed() -> None:
    message = vllm_engine_pb2.GenerateRequest(text="zipped").SerializeToString()
    frame = encode(gzip.compress(message), compressed=True)
    stream = make_stream()
    stream.receive(grpc_headers(("grpc-encoding", "gzip")))
    [need] = stream.receive(body(frame, eos=True))
    assert isinstance(need, NeedRouting) and need.request.body.prompt_text == "zipped"
    assert stream.routed(RoutingDecision(endpoints=("a:1",)))[1] == echo(frame)


def test_body_over_the_limit_is_413_or_resource_exhausted() -> None:
    stream = make_stream(max_body_bytes=100)
    stream.receive(http_headers("/v1/completions"))
    stream.receive(body(b"x" * 60, eos=False))
    [reply] = stream.receive(body(b"x" * 60, eos=False))
    assert reply == http_error(413, "request body exceeds the endpoint picker's 100-byte limit",
                               "PayloadTooLarge", "BadRequestError")
    stream = make_stream(max_body_bytes=100)
    [reply] = stream.receive(grpc_headers(("content-length", "101")))  # refused before the body
    assert reply.immediate_response.grpc_status.status == 8


def test_bad_slo_header_is_400() -> None:
    stream = make_stream()
    stream.receive(grpc_headers(("x-llm-d-slo-ttft-ms", "soon")))
    [reply] = stream.receive(body(GENERATE, eos=True))
    assert reply.immediate_response.grpc_status.status == 3
    assert (b"x-llm-d-slo-ttft-ms"
            in reply.immediate_response.headers.set_headers[2].header.raw_value)


def test_garbage_input_never_raises() -> None:
    stream = make_stream()
    [reply] = stream.receive(ep.ProcessingRequest())
    assert reply.immediate_response.status.code == 400
    stream = make_stream()
    stream.receive(grpc_headers())
    [reply] = stream.receive(grpc_headers())
    assert reply.immediate_response.grpc_status.status == 3


# -- response side and abnormal ends -------------------------------------------------------------


def routed_stream() -> tuple[ExtProcStream, NeedRouting]:
    stream = make_stream()
    need = route_generate(stream)
    stream.routed(RoutingDecision(endpoints=("10.0.0.1:8000",)))
    return stream, need


def test_stream_closed_before_the_response_finishes_once() -> None:
    stream, need = routed_stream()
    stream.receive(response_headers((":status", "200")))
    # Only the stream's close was seen, not the response's end: the router may wait for the
    # request's access-log entry to learn how it ended.
    assert stream.close() == [RequestFinished(need.request, RequestOutcome(
        endpoint="10.0.0.1:8000", ok=False, grpc_status=None, http_status=200, seen_end=False))]
    assert stream.close() == []


def test_grpc_response_with_headers_skipped_finishes_ok_at_the_trailers() -> None:
    # Envoy's response_header_mode SKIP (gRPC pools): the trailers alone carry the outcome.
    stream, need = routed_stream()
    out = stream.receive(response_trailers(
        ("grpc-status", "0"), ("x-kvswitch-usage", "prompt_tokens=4;completion_tokens=2")))
    assert out == [RESPONSE_TRAILERS_OK, RequestFinished(need.request, RequestOutcome(
        endpoint="10.0.0.1:8000", ok=True, grpc_status=0, http_status=None, prompt_tokens=4,
        completion_tokens=2))]


def test_trailers_only_grpc_error_finishes_at_the_headers() -> None:
    stream, need = routed_stream()
    out = stream.receive(response_headers((":status", "200"), ("grpc-status", "13"), eos=True))
    assert out == [RESPONSE_HEADERS_OK, RequestFinished(need.request, RequestOutcome(
        endpoint="10.0.0.1:8000", ok=False, grpc_status=13, http_status=200))]
    assert stream.receive(response_trailers(("grpc-status", "0"))) == [RESPONSE_TRAILERS_OK]
    assert stream.close() == []


def test_http_response_without_trailers_finishes_at_close() -> None:
    stream = make_stream()
    stream.receive(http_headers("/v1/completions"))
    [need] = stream.receive(body(b'{"prompt": [1, 2]}', eos=True))
    assert isinstance(need, NeedRouting)
    stream.routed(RoutingDecision(endpoints=("a:1",)))
    stream.receive(response_headers((":status", "200"), ("content-type", "text/event-stream")))
    [finished] = stream.close()
    assert isinstance(finished, RequestFinished) and finished.outcome.ok
    assert finished.outcome.http_status == 200


# -- routing on headers, request trailers, buffered mode -----------------------------------------


def test_unclaimed_path_is_routed_on_headers_and_its_body_streamed_through() -> None:
    stream = make_stream(passthrough=True)
    [need] = stream.receive(grpc_headers(path=method_path("HealthCheck")))
    assert isinstance(need, NeedRouting) and need.request.body == ParsedBody()
    assert stream.routed(RoutingDecision(endpoints=("a:1",))) == [destination_headers_reply("a:1")]
    assert stream.receive(body(b"part1", eos=False)) == [echo(b"part1", eos=False)]
    assert stream.receive(body(b"part2", eos=True)) == [echo(b"part2")]


def test_header_only_request_gets_no_body_reply() -> None:
    stream = make_stream()
    [need] = stream.receive(http_headers("/v1/models", eos=True))
    assert isinstance(need, NeedRouting)
    out = stream.routed(RoutingDecision(endpoints=("a:1",)))
    assert out == [destination_headers_reply("a:1", grpc=False)]


def test_request_trailers_end_the_body() -> None:
    stream = make_stream()
    stream.receive(grpc_headers())
    assert stream.receive(body(GENERATE, eos=False)) == []
    [need] = stream.receive(ep.ProcessingRequest(request_trailers=ep.HttpTrailers()))
    assert isinstance(need, NeedRouting)
    assert stream.routed(RoutingDecision(endpoints=("a:1",))) == [
        destination_headers_reply("a:1"), echo(GENERATE, eos=False),
        ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]


def test_buffered_mode_answers_headers_at_once_and_routes_on_the_body() -> None:
    stream = make_stream()
    out = stream.receive(grpc_headers(mode=ProcessingMode.BUFFERED))
    assert out == [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]
    [need] = stream.receive(body(GENERATE, eos=True))
    assert isinstance(need, NeedRouting)
    [reply] = stream.routed(RoutingDecision(endpoints=("a:1",)))
    expected = destination_headers_reply("a:1")
    assert reply == ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=expected.request_headers.response),
        dynamic_metadata=expected.dynamic_metadata)
