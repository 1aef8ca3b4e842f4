"""sglanggrpc-parser: SGLang's Generate and Embed bodies, every frame, gzip, limits."""

from __future__ import annotations

import gzip
from typing import Any

import pytest

from kvswitch.epp.contracts import ParsedBody, Parser
from kvswitch.epp.parsers import default_parsers, select_parser, sglanggrpc
from kvswitch.errors import InvalidRequest, PayloadTooLarge
from kvswitch.protocol import GENERATE_PATH
from kvswitch.protocol.grpc_framing import encode
from kvswitch.protocol.sglang import SGLANG_EMBED_PATH, SGLANG_GENERATE_PATH, sglang_method_path
from kvswitch.protocol.sglang import sglang_scheduler_pb2 as pb

GRPC = "application/grpc"


def body(**fields: Any) -> bytes:
    return encode(pb.GenerateRequest(**fields).SerializeToString())


def test_module_exports_type_and_factory() -> None:
    parser = sglanggrpc.create("mine", {}, None)
    assert isinstance(parser, Parser) and parser.name == "mine"
    assert sglanggrpc.TYPE == "sglanggrpc-parser"


def test_claims_only_sglang_generate_and_embed_and_is_a_default() -> None:
    parser = sglanggrpc.SglangGrpcParser()
    assert parser.matches(SGLANG_GENERATE_PATH, GRPC) and parser.matches(SGLANG_EMBED_PATH, GRPC)
    assert not parser.matches(sglang_method_path("GetLoads"), GRPC)
    assert not parser.matches(GENERATE_PATH, GRPC)
    chosen = select_parser(default_parsers(), SGLANG_GENERATE_PATH, GRPC)
    assert chosen is not None and chosen.name == "sglanggrpc-parser"


def test_tokenized_generate_keeps_ids_packed() -> None:
    parsed = sglanggrpc.SglangGrpcParser().parse(SGLANG_GENERATE_PATH, {}, body(
        request_id="r1", stream=True,
        tokenized=pb.TokenizedInput(original_text="hi", input_ids=[1, 300, 70000]),
        sampling_params=pb.SamplingParams(max_new_tokens=7)))
    assert parsed == ParsedBody(prompt_token_ids=(1, 300, 70000), stream=True, max_tokens=7,
                                request_id="r1")
    assert type(parsed.prompt_token_ids).__name__ == "PackedTokenIds"


def test_original_text_alone_is_a_text_prompt() -> None:
    parsed = sglanggrpc.SglangGrpcParser().parse(
        SGLANG_GENERATE_PATH, {}, body(tokenized=pb.TokenizedInput(original_text="hello")))
    assert parsed == ParsedBody(prompt_text="hello")


def test_gzip_and_embed() -> None:
    message = pb.EmbedRequest(request_id="e", tokenized=pb.TokenizedInput(input_ids=[5, 6]))
    framed = encode(gzip.compress(message.SerializeToString()), compressed=True)
    parsed = sglanggrpc.SglangGrpcParser().parse(SGLANG_EMBED_PATH, {"grpc-encoding": "gzip"},
                                                 framed)
    assert parsed == ParsedBody(prompt_token_ids=(5, 6), request_id="e")


def test_split_frames_are_one_message() -> None:
    whole = body(tokenized=pb.TokenizedInput(input_ids=list(range(1000))))
    # One frame, however the body arrived; the parser reads the whole body.
    parsed = sglanggrpc.SglangGrpcParser().parse(SGLANG_GENERATE_PATH, {}, whole)
    assert parsed.prompt_token_ids is not None and len(parsed.prompt_token_ids) == 1000


@pytest.mark.parametrize(("raw", "match"), [
    (b"", "exactly one request message, the body holds 0"),
    (body(request_id="a") + body(request_id="b"), "holds more than 1 gRPC message"),
    (body(request_id="a")[:-1], "truncated"),
    (encode(b"\xff\xff\xff"), "malformed GenerateRequest"),
])
def test_bad_bodies_are_invalid(raw: bytes, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        sglanggrpc.SglangGrpcParser().parse(SGLANG_GENERATE_PATH, {}, raw)


def test_message_limit_and_bad_parameter() -> None:
    parser = sglanggrpc.create("p", {"maxMessageBytes": 8}, None)
    with pytest.raises(PayloadTooLarge):
        parser.parse(SGLANG_GENERATE_PATH, {}, body(request_id="longer than eight"))
    with pytest.raises(ValueError, match="maxMessageBytes"):
        sglanggrpc.create("p", {"maxMessageBytes": 0}, None)
