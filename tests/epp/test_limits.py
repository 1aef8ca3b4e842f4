"""The EPP bounds a request's sampling counts (`SamplingLimits`) before routing it: a tiny
request asking for absurd work is refused with INVALID_ARGUMENT (gRPC) or 400 (OpenAI),
naming the field, and never reaches the router."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvswitch.epp.contracts import EndpointPicker
from kvswitch.epp.extproc import ExtProcStream, NeedRouting
from kvswitch.epp.parsers import default_parsers
from kvswitch.epp.parsers.vllmgrpc import VllmGrpcParser
from kvswitch.errors import InvalidRequest
from kvswitch.limits import SamplingLimits
from kvswitch.protocol import GENERATE_PATH
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.grpc_framing import encode
from tests.support.extproc import NeverRouter, body, decoded, grpc_headers, http_headers

LIMITS = SamplingLimits(max_n=8, max_logprobs=5, max_stop=4, max_stop_chars=16,
                        max_logit_bias=10, max_tokens=1000)


def stream() -> ExtProcStream:
    picker = EndpointPicker(parsers=default_parsers(), router=NeverRouter(),
                            sampling_limits=LIMITS)
    return ExtProcStream(picker, clock=lambda: 0.0)


def send_grpc(**sampling: Any) -> Any:
    message = pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(**sampling))
    s = stream()
    s.receive(grpc_headers())
    [out] = decoded(s.receive(body(encode(message.SerializeToString()), eos=True)))
    return out


def send_openai(path: str, payload: dict[str, Any]) -> Any:
    s = stream()
    s.receive(http_headers(path))
    [out] = decoded(s.receive(body(orjson.dumps(payload), eos=True)))
    return out


def test_within_the_limits_is_routed() -> None:
    assert isinstance(send_grpc(n=8, stop=["a"] * 4, max_tokens=1000), NeedRouting)
    assert isinstance(send_openai("/v1/completions", {
        "prompt": "hi", "n": 8, "best_of": 8, "logprobs": 5, "stop": ["abc"] * 4,
        "logit_bias": {str(i): 1 for i in range(10)}, "max_tokens": 1000}), NeedRouting)


@pytest.mark.parametrize(("sampling", "field"), [
    ({"n": 9}, "n"),
    ({"n": 2**32 - 1}, "n"),
    ({"stop": ["a"] * 5}, "stop"),
    ({"stop": ["a" * 17]}, "stop"),
    ({"stop_token_ids": [1] * 5}, "stop_token_ids"),
    ({"logit_bias": {i: 1.0 for i in range(11)}}, "logit_bias"),
    ({"max_tokens": 1001}, "max_tokens"),
])
def test_grpc_counts_over_the_limits_are_invalid_argument(sampling: dict[str, Any],
                                                          field: str) -> None:
    reply = send_grpc(**sampling)
    assert reply.immediate_response.grpc_status.status == 3
    message = {h.header.key: h.header.raw_value.decode()
               for h in reply.immediate_response.headers.set_headers}["grpc-message"]
    assert message.startswith(f"{field}:") and "limit" in message


@pytest.mark.parametrize(("path", "payload", "field"), [
    ("/v1/completions", {"prompt": "hi", "n": 1000000}, "n"),
    ("/v1/completions", {"prompt": "hi", "best_of": 9}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 17}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 5}, "stop"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(11)}},
     "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 10**9}, "max_tokens"),
])
def test_openai_counts_over_the_limits_are_400(path: str, payload: dict[str, Any],
                                               field: str) -> None:
    reply = send_openai(path, payload)
    assert reply.immediate_response.status.code == 400
    error = orjson.loads(reply.immediate_response.body)["error"]
    assert error["param"] == field and "limit" in error["message"]


def test_a_batched_prompt_fan_out_is_bounded() -> None:
    assert isinstance(send_openai("/v1/completions", {"prompt": ["a"] * 4, "n": 2}), NeedRouting)
    reply = send_openai("/v1/completions", {"prompt": [[1], [2], [3]] * 700})
    assert reply.immediate_response.status.code == 400
    error = orjson.loads(reply.immediate_response.body)["error"]
    assert error["param"] == "prompt" and "--max-sequences" in error["message"]


def test_a_body_of_many_messages_is_refused_at_the_second() -> None:
    # 16 MiB of empty frames: refused when the second frame is seen, not after decoding 3 M.
    body = encode(b"") * (16 * 1024 * 1024 // 5)
    with pytest.raises(InvalidRequest, match="more than 1 gRPC message"):
        VllmGrpcParser().parse(GENERATE_PATH, {}, body)


def test_a_content_length_that_is_not_a_number_is_400() -> None:
    s = stream()
    [reply] = decoded(s.receive(http_headers("/v1/completions", ("content-length", "12abc"))))
    assert reply.immediate_response.status.code == 400
