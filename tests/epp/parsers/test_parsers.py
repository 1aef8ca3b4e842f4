"""Request-body parsers: vllmgrpc, openai, passthrough, and parser selection."""

from __future__ import annotations

import gzip
from typing import Any

import orjson
import pytest

from kvswitch.epp.contracts import ParsedBody, Parser
from kvswitch.epp.parsers import (
    default_parsers,
    needs_body,
    openai,
    passthrough,
    select_parser,
    vllmgrpc,
)
from kvswitch.errors import InvalidRequest, PayloadTooLarge
from kvswitch.protocol import EMBED_PATH, GENERATE_PATH, method_path, vllm_engine_pb2
from kvswitch.protocol.grpc_framing import encode

GRPC = "application/grpc"


def generate_body(**fields: Any) -> bytes:
    return encode(vllm_engine_pb2.GenerateRequest(**fields).SerializeToString())


@pytest.mark.parametrize("module", [vllmgrpc, openai, passthrough])
def test_modules_export_type_and_factory(module: Any) -> None:
    parser = module.create("mine", {}, None)
    assert isinstance(parser, Parser)
    assert parser.name == "mine"
    assert module.TYPE == f"{module.__name__.rsplit('.', 1)[1]}-parser"


# -- vllmgrpc -------------------------------------------------------------------------------------


def test_tokenized_generate() -> None:
    body = generate_body(
        request_id="r1",
        tokenized=vllm_engine_pb2.TokenizedInput(original_text="hi", input_ids=[1, 2, 3]),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=7),
        stream=True,
    )
    parsed = vllmgrpc.create("p", {}, None).parse(GENERATE_PATH, {}, body)
    assert parsed == ParsedBody(prompt_token_ids=(1, 2, 3), stream=True, max_tokens=7,
                                request_id="r1")


def test_text_generate_without_max_tokens() -> None:
    parsed = vllmgrpc.VllmGrpcParser().parse(GENERATE_PATH, {}, generate_body(text="hello"))
    assert parsed == ParsedBody(prompt_text="hello")


def test_gzip_frame_is_decompressed() -> None:
    message = vllm_engine_pb2.GenerateRequest(text="zipped").SerializeToString()
    body = encode(gzip.compress(message), compressed=True)
    parsed = vllmgrpc.VllmGrpcParser().parse(GENERATE_PATH, {"grpc-encoding": "gzip"}, body)
    assert parsed.prompt_text == "zipped"


def test_embed() -> None:
    message = vllm_engine_pb2.EmbedRequest(
        request_id="e", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6])
    )
    parsed = vllmgrpc.VllmGrpcParser().parse(EMBED_PATH, {}, encode(message.SerializeToString()))
    assert parsed == ParsedBody(prompt_token_ids=(5, 6), request_id="e")


def test_vllmgrpc_claims_only_generate_and_embed() -> None:
    parser = vllmgrpc.VllmGrpcParser()
    assert parser.matches(GENERATE_PATH, GRPC) and parser.matches(EMBED_PATH, GRPC)
    assert not parser.matches(method_path("HealthCheck"), GRPC)
    assert not parser.matches("/v1/completions", "application/json")


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"", "exactly one request message, the body holds 0"),
        (generate_body(text="a") + generate_body(text="b"), "holds more than 1 gRPC message"),
        (generate_body(text="a")[:-1], "truncated"),
        (encode(b"\xff\xff\xff"), "malformed GenerateRequest"),
    ],
)
def test_bad_grpc_bodies_are_invalid(body: bytes, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        vllmgrpc.VllmGrpcParser().parse(GENERATE_PATH, {}, body)


def test_grpc_message_limit() -> None:
    parser = vllmgrpc.create("p", {"maxMessageBytes": 8}, None)
    with pytest.raises(PayloadTooLarge):
        parser.parse(GENERATE_PATH, {}, generate_body(text="longer than eight"))
    with pytest.raises(ValueError, match="maxMessageBytes"):
        vllmgrpc.create("p", {"maxMessageBytes": "big"}, None)


# -- openai ---------------------------------------------------------------------------------------


def parse_json(path: str, data: Any) -> ParsedBody:
    return openai.OpenAIParser().parse(path, {}, orjson.dumps(data))


@pytest.mark.parametrize(
    ("prompt", "text", "tokens"),
    [
        ("hello", "hello", None),
        (["a", "b"], "a\nb", None),
        ([1, 2, 3], None, (1, 2, 3)),
        ([[1, 2], [3]], None, (1, 2, 3)),
    ],
)
def test_completion_prompt_shapes(prompt: Any, text: str | None, tokens: Any) -> None:
    parsed = parse_json("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 5})
    assert parsed == ParsedBody(model="m", prompt_text=text, prompt_token_ids=tokens, max_tokens=5)


def test_chat_messages_concatenate_text_content_and_parts() -> None:
    parsed = parse_json("/v1/chat/completions", {
        "model": "m", "stream": True, "max_tokens": 9, "max_completion_tokens": 4,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "},
                                         {"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "there"}]},
        ],
    })
    assert parsed == ParsedBody(model="m", prompt_text="system: be brief\nuser: hi there\n",
                                stream=True, max_tokens=4)


@pytest.mark.parametrize(
    ("path", "body", "match"),
    [
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/completions", b"[1]", "must be a JSON object"),
        ("/v1/completions", b'{"prompt": 5}', "'prompt' must be"),
        ("/v1/completions", b'{"prompt": [true, 1]}', "'prompt' must be"),
        ("/v1/completions", b'{"prompt": [1, 4294967296]}', "'prompt' must be"),  # > uint32
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "5"}', "'max_tokens' must be a int"),
        ("/v1/completions", b'{"prompt": "x", "stream": 1}', "'stream' must be a bool"),
        ("/v1/chat/completions", b'{"messages": []}', "'messages' must be a non-empty list"),
        ("/v1/chat/completions", b'{"messages": ["x"]}', "each message must be an object"),
        ("/v1/chat/completions", b'{"messages": [{"content": 3}]}', "'content' must be"),
    ],
)
def test_malformed_openai_bodies_are_invalid(path: str, body: bytes, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as info:
        openai.OpenAIParser().parse(path, {}, body)
    assert info.value.http_status == 400


def test_invalid_field_names_the_param() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_json("/v1/completions", {"prompt": "x", "max_tokens": 1.5})
    assert info.value.param == "max_tokens"


# -- selection ------------------------------------------------------------------------------------


def test_selection_order_query_strings_and_passthrough() -> None:
    parsers = [*default_parsers(), passthrough.create("pt", {}, None)]
    assert (select_parser(parsers, GENERATE_PATH, GRPC).name  # type: ignore[union-attr]
            == "vllmgrpc-parser")
    chosen = select_parser(parsers, "/v1/chat/completions?x=1", "application/json")
    assert chosen is not None and chosen.name == "openai-parser"
    other = select_parser(parsers, "/v1/models", "")
    assert other is not None and other.name == "pt" and not needs_body(other)
    assert select_parser(default_parsers(), "/v1/models", "") is None
    assert not needs_body(None) and needs_body(parsers[0])
