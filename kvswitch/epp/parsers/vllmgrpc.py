"""`vllmgrpc-parser`: decodes vLLM gRPC engine requests (`VllmEngine/Generate` and `/Embed`).

The body is gRPC-framed (`kvswitch.protocol.grpc_framing`); compressed frames are inflated per the
call's `grpc-encoding`. Both methods are unary-request, so the body must hold exactly one
message. Tokenized input yields `prompt_token_ids` (exact prefix routing) as `PackedTokenIds`,
read through a view that leaves the ids packed (`kvswitch.protocol.packed`) once the real parse
has checked the message; text input yields `prompt_text`.

Parameters: `maxMessageBytes` (default 16 MiB) bounds one decompressed message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

from kvswitch.epp.contracts import ParsedBody
from kvswitch.errors import InvalidRequest
from kvswitch.limits import proto_sampling_counts
from kvswitch.protocol import EMBED_PATH, GENERATE_PATH, vllm_engine_pb2
from kvswitch.protocol.grpc_framing import decode_all, single_message
from kvswitch.protocol.packed import EmbedRequestView, GenerateRequestView, PackedTokenIds

__all__ = ["TYPE", "VllmGrpcParser", "create"]

TYPE = "vllmgrpc-parser"
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_IDENTITY = (None, "", "identity")
M = TypeVar("M", bound=Message)


class VllmGrpcParser:
    def __init__(self, name: str = TYPE, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.name = name
        self.max_message_bytes = max_message_bytes

    def matches(self, path: str, content_type: str) -> bool:
        return path == GENERATE_PATH or path == EMBED_PATH

    def parse(self, path: str, headers: Mapping[str, str], body: bytes) -> ParsedBody:
        message = request_message(path, headers, body, self.max_message_bytes)
        if path == EMBED_PATH:
            return _parse_embed(message)
        return _parse_generate(message)


def request_message(path: str, headers: Mapping[str, str], body: bytes,
                    max_message_bytes: int) -> bytes:
    """The one message of a unary-request gRPC body (every frame read, inflated per
    `grpc-encoding`); `InvalidRequest` / `PayloadTooLarge` otherwise."""
    message = single_message(body, max_message_bytes)
    if message is None or headers.get("grpc-encoding") not in _IDENTITY:
        messages = decode_all(
            body, encoding=headers.get("grpc-encoding"), max_message_bytes=max_message_bytes,
            max_messages=1,
        )
        if len(messages) != 1:
            raise InvalidRequest(
                f"{path} takes exactly one request message, the body holds {len(messages)}"
            )
        message = messages[0]
    return message


def decode(cls: type[M], message: bytes) -> M:
    """`message` parsed as `cls`; `InvalidRequest` naming the message type if it does not
    decode."""
    try:
        return cls.FromString(message)
    except DecodeError as exc:
        raise InvalidRequest(f"malformed {cls.DESCRIPTOR.name}: {exc}") from exc


def _parse_generate(message: bytes) -> ParsedBody:
    request = decode(vllm_engine_pb2.GenerateRequest, message)
    kind = request.WhichOneof("input")
    params = request.sampling_params
    return ParsedBody(
        prompt_token_ids=(_prompt(GenerateRequestView, message, request)
                          if kind == "tokenized" else None),
        prompt_text=request.text if kind == "text" else None,
        stream=request.stream,
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        request_id=request.request_id or None,
        sampling=proto_sampling_counts(params),
    )


def _parse_embed(message: bytes) -> ParsedBody:
    request = decode(vllm_engine_pb2.EmbedRequest, message)
    return ParsedBody(
        prompt_token_ids=_prompt(EmbedRequestView, message, request),
        request_id=request.request_id or None,
    )


def _prompt(view: Any, message: bytes, request: Any) -> PackedTokenIds:
    """The prompt's ids, left packed: read again through the view (upb only points at the
    payload), not as the real message's ints. The real parse has checked every varint."""
    packed = view.FromString(message).tokenized.input_ids
    if packed or not request.tokenized.input_ids:
        return PackedTokenIds(packed)
    return PackedTokenIds.of(request.tokenized.input_ids)  # sent unpacked: the view saw none


def max_message_bytes(name: str, parameters: Mapping[str, Any]) -> int:
    """The `maxMessageBytes` parameter of a gRPC parser, checked."""
    limit = parameters.get("maxMessageBytes", DEFAULT_MAX_MESSAGE_BYTES)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        raise ValueError(f"{name}: maxMessageBytes must be a positive integer, got {limit!r}")
    return limit


def create(name: str, parameters: Mapping[str, Any], handle: Any) -> VllmGrpcParser:
    return VllmGrpcParser(name, max_message_bytes=max_message_bytes(name, parameters))
