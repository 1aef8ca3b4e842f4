"""`sglanggrpc-parser`: decodes SGLang gRPC scheduler requests (`SglangScheduler/Generate` and
`/Embed`).

The body is read as the vLLM parser reads its own (`vllmgrpc.request_message`: every frame,
inflated per `grpc-encoding`, exactly one message, `maxMessageBytes` per decompressed message).
SGLang's requests are tokenized: `tokenized.input_ids` yields `prompt_token_ids`, left packed
(`kvswitch.protocol.packed`) for exact prefix routing; a request with only
`tokenized.original_text` (no ids) yields `prompt_text`. `max_tokens` is
`sampling_params.max_new_tokens` when set.

Parameters: `maxMessageBytes` (default 16 MiB) bounds one decompressed message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvswitch.epp.contracts import ParsedBody
from kvswitch.epp.parsers.vllmgrpc import (
    DEFAULT_MAX_MESSAGE_BYTES,
    decode,
    max_message_bytes,
    request_message,
)
from kvswitch.protocol.packed import (
    PackedTokenIds,
    SglangEmbedRequestView,
    SglangGenerateRequestView,
)
from kvswitch.protocol.sglang import SGLANG_EMBED_PATH, SGLANG_GENERATE_PATH
from kvswitch.protocol.sglang import sglang_scheduler_pb2 as pb

__all__ = ["TYPE", "SglangGrpcParser", "create"]

TYPE = "sglanggrpc-parser"


class SglangGrpcParser:
    def __init__(self, name: str = TYPE, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.name = name
        self.max_message_bytes = max_message_bytes

    def matches(self, path: str, content_type: str) -> bool:
        return path == SGLANG_GENERATE_PATH or path == SGLANG_EMBED_PATH

    def parse(self, path: str, headers: Mapping[str, str], body: bytes) -> ParsedBody:
        message = request_message(path, headers, body, self.max_message_bytes)
        if path == SGLANG_EMBED_PATH:
            embed = decode(pb.EmbedRequest, message)
            ids, text = _prompt(SglangEmbedRequestView, message, embed)
            return ParsedBody(prompt_token_ids=ids, prompt_text=text,
                              request_id=embed.request_id or None)
        request = decode(pb.GenerateRequest, message)
        ids, text = _prompt(SglangGenerateRequestView, message, request)
        params = request.sampling_params
        return ParsedBody(
            prompt_token_ids=ids, prompt_text=text, stream=request.stream,
            max_tokens=params.max_new_tokens if params.HasField("max_new_tokens") else None,
            request_id=request.request_id or None)


def _prompt(view: Any, message: bytes, request: Any) -> tuple[PackedTokenIds | None, str | None]:
    """(ids, None) for tokenized input, (None, text) for original_text alone, else neither."""
    tokenized = request.tokenized
    if tokenized.input_ids:
        packed = view.FromString(message).tokenized.input_ids
        # Sent unpacked, the view saw none: take the real message's ids.
        return (PackedTokenIds(packed) if packed else PackedTokenIds.of(tokenized.input_ids),
                None)
    return None, tokenized.original_text or None


def create(name: str, parameters: Mapping[str, Any], handle: Any) -> SglangGrpcParser:
    return SglangGrpcParser(name, max_message_bytes=max_message_bytes(name, parameters))
