"""Replies built serialized: each reads back through the real protobuf as the message it names."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from kvswitch.epp.extproc_messages import (
    destination_reply,
    parse_usage,
    response_status,
    streamed_body,
    streamed_body_chunks,
)
from tests.support.extproc import destination_headers_reply, header_map


def streamed(data: bytes, end: bool, *, response: bool = False) -> ep.ProcessingResponse:
    body = ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(
        streamed_response=ep.StreamedBodyResponse(body=data, end_of_stream=end))))
    return ep.ProcessingResponse(response_body=body) if response else ep.ProcessingResponse(
        request_body=body)


# Sizes around every varint width the envelope crosses (1, 2 and 3 bytes; >= 2 MiB: 4 bytes).
@pytest.mark.parametrize("size", [0, 1, 100, 117, 118, 119, 120, 121, 127, 128, 16371, 16375,
                                  16384, 70000, (1 << 21) + 5])
@pytest.mark.parametrize("end", [False, True])
@pytest.mark.parametrize("response", [False, True])
def test_streamed_body_is_what_protobuf_serializes(size: int, end: bool, response: bool) -> None:
    data = bytes(i % 251 for i in range(size))
    wire = streamed_body(data, end, response=response)
    assert type(wire) is bytes
    assert wire == streamed(data, end, response=response).SerializeToString()
    assert ep.ProcessingResponse.FromString(wire) == streamed(data, end, response=response)
    assert streamed_body(data, end, response=response) == wire  # its head kept, per size


def test_a_big_echo_is_cut_in_chunks_that_end_once() -> None:
    data = bytes(range(256)) * 8193  # just over 2 MiB: three chunks
    chunks = [ep.ProcessingResponse.FromString(c) for c in streamed_body_chunks(data, True)]
    parts = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert b"".join(p.body for p in parts) == data
    assert [p.end_of_stream for p in parts] == [False, False, True]


@pytest.mark.parametrize("grpc", [False, True])
def test_destination_replies_are_kept_per_destination(grpc: bool) -> None:
    first = destination_reply("10.0.0.1:8000,10.0.0.2:8000", grpc=grpc, on_body=False)
    assert destination_reply("10.0.0.1:8000,10.0.0.2:8000", grpc=grpc, on_body=False) is first
    assert ep.ProcessingResponse.FromString(first) == destination_headers_reply(
        "10.0.0.1:8000,10.0.0.2:8000", grpc=grpc)
    other = ep.ProcessingResponse.FromString(destination_reply("10.0.0.3:8000", grpc=grpc,
                                                               on_body=True))
    assert other.request_body.response.header_mutation.set_headers[0].header.raw_value == (
        b"10.0.0.3:8000")


def test_usage_trailer_items_may_be_spaced_and_bad_ones_are_skipped() -> None:
    assert parse_usage("prompt_tokens=12;completion_tokens=64;cached_tokens=0") == {
        "prompt_tokens": 12, "completion_tokens": 64, "cached_tokens": 0}
    assert parse_usage(" prompt_tokens = 12 ;completion_tokens=-1;cached_tokens=x;junk;=") == {
        "prompt_tokens": 12}


def test_response_status_reads_status_grpc_status_and_usage_only() -> None:
    trailers = header_map([("grpc-status", "0"), ("grpc-message", "ok"),
                           ("x-kvswitch-usage", "prompt_tokens=3;completion_tokens=4")])
    assert response_status(trailers, None, None) == (
        None, 0, {"prompt_tokens": 3, "completion_tokens": 4})
    headers = header_map([(":status", "200"), ("content-type", "application/grpc")])
    usage = {"prompt_tokens": 1}
    assert response_status(headers, 5, usage) == ("200", 5, usage)  # absent: kept as given
    assert response_status(header_map([("grpc-status", "x"), ("x-kvswitch-usage", "")]), 2,
                           None) == (None, 2, None)  # unreadable: kept as given
