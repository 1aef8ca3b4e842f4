"""Envoy ext_proc messages for the request path: reading them and building the replies.

Pure functions and prebuilt replies: `ExtProcStream` (`kvswitch.epp.extproc`) decides what to
send, this module knows how ext_proc spells it. Replies come serialized (`SerializedResponse`):
constant ones are built once, destination replies once per destination, the body echo is
encoded by hand.
"""

from __future__ import annotations

import urllib.parse
from typing import NewType

import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3.http_status_pb2 import HttpStatus

from kvswitch.epp.contracts import InferenceRequest, ParsedBody
from kvswitch.errors import InvalidRequest, grpc_code_for_http, openai_type_for_http
from kvswitch.protocol import headers as h

__all__ = [
    "BODY_CONTINUE", "HEADERS_CONTINUE", "RESPONSE_BODY_CONTINUE", "RESPONSE_HEADERS_CONTINUE",
    "RESPONSE_TRAILERS_CONTINUE", "TRAILERS_CONTINUE", "SerializedResponse", "destination_reply",
    "gateway_metadata", "header_dict", "immediate_error", "inference_request", "parse_usage",
    "response_status", "streamed_body", "streamed_body_chunks",
]


# -- reading Envoy's messages ------------------------------------------------------------------


def header_dict(header_map: HeaderMap) -> dict[str, str]:
    """Envoy headers as {lowercase name: value}; Envoy sends `raw_value` (bytes) by default."""
    # latin-1 never fails: header bytes are opaque octets (RFC 9110), names are ASCII.
    return {x.key: x.raw_value.decode("latin-1") or x.value for x in header_map.headers}


def response_status(
    header_map: HeaderMap, grpc_status: int | None, usage: dict[str, int] | None
) -> tuple[str | None, int | None, dict[str, int] | None]:
    """(`:status`, grpc-status, parsed usage trailer) from response headers or trailers; the
    given grpc-status and usage stand where the map lacks them. Only these three fields are
    read: no dict of every header is built (≈ 1 us less per request than `header_dict`)."""
    status = code = value = None  # the last of each wins, as in `header_dict`
    for header in header_map.headers:
        key = header.key
        if key == "grpc-status":
            code = header.raw_value.decode("latin-1") or header.value
        elif key == h.USAGE_TRAILER:
            value = header.raw_value.decode("latin-1") or header.value
        elif key == ":status":
            status = header.raw_value.decode("latin-1") or header.value
    if code is not None and code.isdigit():
        grpc_status = int(code)
    if value:
        usage = parse_usage(value)
    return status, grpc_status, usage


def gateway_metadata(message: ep.ProcessingRequest,
                     headers: dict[str, str]) -> tuple[bool, tuple[str, ...] | None]:
    """What the gateway says of a request: whether it logs it to the EPP (`kvswitch` filter
    metadata, which no client can set), and the proxy's subset hint (`envoy.lb.subset_hint`
    filter metadata, else the header; None: no hint)."""
    logged = False
    hint: tuple[str, ...] | None = None
    # Envoy sends metadata_context only when configured to: asking first skips building the
    # map's wrappers (≈ 0.3 us) on every request without it.
    if message.HasField("metadata_context"):
        metadata = message.metadata_context.filter_metadata
        ours = metadata.get(h.GATEWAY_METADATA_NAMESPACE)
        if ours is not None and h.ACCESS_LOGGED in ours.fields:
            logged = ours.fields[h.ACCESS_LOGGED].bool_value
        namespace = metadata.get(h.SUBSET_HINT_NAMESPACE)
        if namespace is not None and h.DESTINATION_SUBSET in namespace.fields:
            value = namespace.fields[h.DESTINATION_SUBSET]
            if value.WhichOneof("kind") == "list_value":
                hint = tuple(v.string_value for v in value.list_value.values if v.string_value)
            else:
                hint = _split_addresses(value.string_value)
    if hint is None:
        header = headers.get(h.DESTINATION_SUBSET)
        hint = None if header is None else _split_addresses(header)
    return logged, hint


def _split_addresses(value: str) -> tuple[str, ...]:
    return tuple(a for a in (p.strip() for p in value.split(",")) if a)


def _slo(headers: dict[str, str], name: str) -> float | None:
    value = headers.get(name)
    if value is None:
        return None
    try:
        slo = float(value)
    except ValueError:
        slo = -1.0
    if not slo >= 0:  # also rejects NaN
        raise InvalidRequest(f"header {name} must be a non-negative number of ms, got {value!r}")
    return slo


def inference_request(
    headers: dict[str, str], parsed: ParsedBody, request_id: str, *, grpc: bool, size: int,
    received_at: float, path: str | None = None, access_logged: bool = False,
) -> InferenceRequest:
    """`path`: `:path` without its query, if the caller has it already."""
    if not headers.keys().isdisjoint(h.ALIASES):  # one C call when (as usual) none is there
        for alias, name in h.ALIASES.items():  # the current names win over the old ones
            if alias in headers and name not in headers:
                headers[name] = headers[alias]
    headers.pop(h.DESTINATION_ENDPOINT, None)  # client-supplied: never trusted, never passed on
    return InferenceRequest(
        request_id=request_id,
        protocol="grpc" if grpc else "http",
        path=path if path is not None else headers.get(":path", "/").split("?", 1)[0],
        body=parsed,
        objective=headers.get(h.OBJECTIVE) or None,
        fairness_id=headers.get(h.FAIRNESS_ID) or h.DEFAULT_FAIRNESS_ID,
        slo_ttft_ms=_slo(headers, h.SLO_TTFT_MS),
        slo_tpot_ms=_slo(headers, h.SLO_TPOT_MS),
        headers=headers,
        body_size=size,
        received_at=received_at,
        access_logged=access_logged,
        model=parsed.model or headers.get(h.MODEL_NAME, ""),
    )


def parse_usage(value: str) -> dict[str, int]:
    """`prompt_tokens=12;completion_tokens=64;cached_tokens=0` -> dict; bad items are skipped."""
    usage: dict[str, int] = {}
    for item in value.split(";"):
        key, _, number = item.partition("=")
        if not number.isdigit():  # spaces are rare: strip only then
            number = number.strip()
            if not number.isdigit():
                continue
        usage[key.strip()] = int(number)
    return usage


# -- building replies --------------------------------------------------------------------------

SerializedResponse = NewType("SerializedResponse", bytes)
"""A ProcessingResponse in wire form: the transports send it as is. Replies are built
serialized because their bytes repeat (constants, one per destination) or are a few length
prefixes around the body (the echo): no message is built and serialized per request."""


def _serialized(reply: ep.ProcessingResponse) -> SerializedResponse:
    return SerializedResponse(reply.SerializeToString())


HEADERS_CONTINUE = _serialized(ep.ProcessingResponse(request_headers=ep.HeadersResponse()))
BODY_CONTINUE = _serialized(ep.ProcessingResponse(request_body=ep.BodyResponse()))
TRAILERS_CONTINUE = _serialized(ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))
RESPONSE_HEADERS_CONTINUE = _serialized(
    ep.ProcessingResponse(response_headers=ep.HeadersResponse()))
RESPONSE_BODY_CONTINUE = _serialized(ep.ProcessingResponse(response_body=ep.BodyResponse()))
RESPONSE_TRAILERS_CONTINUE = _serialized(
    ep.ProcessingResponse(response_trailers=ep.TrailersResponse()))

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# Envoy's ext_proc client has no small message limit, but keep each echoed chunk modest.
_ECHO_CHUNK_BYTES = 1024 * 1024


def _header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


_TE_TRAILERS = _header("te", "trailers")
# Destinations repeat (a pool's endpoints, a pick and its fallbacks): their replies are kept.
_DESTINATION_REPLIES_MAX = 4096
_destination_replies: dict[tuple[str, bool, bool, str], SerializedResponse] = {}


def destination_reply(destination: str, *, grpc: bool, on_body: bool,
                      replica: str = "") -> SerializedResponse:
    """Route to `destination`: the header (overwriting any client-supplied copy, which is never
    trusted) and the same value under `envoy.lb` dynamic metadata, with the routing EPP's
    `replica` name when it has one. `on_body`: reply to the last body chunk (buffered modes)
    instead of the request headers."""
    key = (destination, grpc, on_body, replica)
    reply = _destination_replies.get(key)
    if reply is None:
        if len(_destination_replies) >= _DESTINATION_REPLIES_MAX:
            _destination_replies.clear()
        reply = _destination_replies[key] = _serialized(
            _destination_message(destination, grpc=grpc, on_body=on_body, replica=replica))
    return reply


def _destination_message(destination: str, *, grpc: bool, on_body: bool,
                         replica: str) -> ep.ProcessingResponse:
    # Filled through attribute paths: several times cheaper in upb than nested kwargs.
    reply = ep.ProcessingResponse()
    common = reply.request_body.response if on_body else reply.request_headers.response
    sets = common.header_mutation.set_headers
    option = sets.add()
    option.header.key = h.DESTINATION_ENDPOINT
    option.header.raw_value = destination.encode()
    option.append_action = _OVERWRITE
    if grpc:  # gRPC upstreams reject requests without `te: trailers`
        sets.append(_TE_TRAILERS)
    lb = reply.dynamic_metadata.fields[h.DESTINATION_METADATA_NAMESPACE].struct_value
    lb.fields[h.DESTINATION_ENDPOINT].string_value = destination
    if replica:
        lb.fields[h.EPP_REPLICA].string_value = replica
    return reply


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# The echo's envelope, outermost first, as (field number << 3 | length-delimited) tags:
# ProcessingResponse.request_body (3) or .response_body (4) -> BodyResponse.response (1) ->
# CommonResponse.body_mutation (3) -> BodyMutation.streamed_response (3).
_REQUEST_ECHO_TAGS = (b"\x1a", b"\x0a", b"\x1a", b"\x1a")
_RESPONSE_ECHO_TAGS = (b"\x22", b"\x0a", b"\x1a", b"\x1a")
_STREAMED_BODY_TAG = b"\x0a"  # StreamedBodyResponse.body (1)
_STREAMED_END = b"\x10\x01"  # StreamedBodyResponse.end_of_stream (2) = true


def streamed_body(body: bytes, end: bool, *, response: bool = False) -> SerializedResponse:
    """`ProcessingResponse{request_body{response{body_mutation{streamed_response{body,
    end_of_stream}}}}}` (`response`: response_body), encoded by hand as protobuf would: the
    body between a few length prefixes. Empty and false fields are left out, as proto3 does."""
    key = (len(body), end, response)
    head = _echo_heads.get(key)
    if head is None:
        head = _echo_head(*key)
    return SerializedResponse(b"".join((head, body, _STREAMED_END if end else b"")))


# Echo heads depend on the body's size only; sizes repeat (a client's prompts, fixed lengths).
_ECHO_HEADS_MAX = 4096
_echo_heads: dict[tuple[int, bool, bool], bytes] = {}


def _echo_head(size: int, end: bool, response: bool) -> bytes:
    """Everything before the body bytes: the envelope's prefixes and the body's."""
    head = _STREAMED_BODY_TAG + _varint(size) if size else b""
    length = len(head) + size + (len(_STREAMED_END) if end else 0)
    for tag in reversed(_RESPONSE_ECHO_TAGS if response else _REQUEST_ECHO_TAGS):
        prefix = tag + _varint(length)
        head = prefix + head
        length += len(prefix)
    if len(_echo_heads) >= _ECHO_HEADS_MAX:
        _echo_heads.clear()
    _echo_heads[size, end, response] = head
    return head


def streamed_body_chunks(body: bytes, end: bool) -> list[SerializedResponse]:
    if len(body) <= _ECHO_CHUNK_BYTES:
        return [streamed_body(body, end)]
    starts = range(0, len(body), _ECHO_CHUNK_BYTES)
    return [
        streamed_body(body[i : i + _ECHO_CHUNK_BYTES], end and i + _ECHO_CHUNK_BYTES >= len(body))
        for i in starts
    ]


# gRPC percent-encodes grpc-message bytes outside printable ASCII, and '%' itself.
_GRPC_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def _grpc_message(message: str) -> str:
    return urllib.parse.quote(message, safe=_GRPC_MESSAGE_SAFE)


def immediate_error(
    status: int, message: str, reason: str, *, grpc: bool, param: str | None = None
) -> SerializedResponse:
    """A local reply: trailers-only gRPC status for gRPC calls, OpenAI-style JSON for HTTP."""
    dropped = _header(h.DROPPED_REASON, reason)
    if grpc:
        code = grpc_code_for_http(status).value[0]
        headers = [
            _header("content-type", "application/grpc"),
            _header("grpc-status", str(code)),
            _header("grpc-message", _grpc_message(message)),
            dropped,
        ]
        immediate = ep.ImmediateResponse(
            status=HttpStatus(code=200),
            headers=ep.HeaderMutation(set_headers=headers),
            grpc_status=ep.GrpcStatus(status=code),
        )
    else:
        error = {"message": message, "type": openai_type_for_http(status), "param": param,
                 "code": status}
        immediate = ep.ImmediateResponse(
            status=HttpStatus(code=status),  # type: ignore[arg-type,unused-ignore]
            headers=ep.HeaderMutation(
                set_headers=[_header("content-type", "application/json"), dropped]
            ),
            body=orjson.dumps({"error": error}),
        )
    return _serialized(ep.ProcessingResponse(immediate_response=immediate))
