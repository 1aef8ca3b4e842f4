"""Envoy ext_proc messages for the request path: reading them and building the replies.

Pure functions and prebuilt constant replies, no state: `ExtProcStream` (`kvswitch.epp.extproc`)
decides what to send, this module knows how ext_proc spells it. Replies are filled through
attribute paths (several times cheaper in upb than nested constructor kwargs) and constant
replies are built once.
"""

from __future__ import annotations

import urllib.parse

import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3.http_status_pb2 import HttpStatus

from kvswitch.epp.request import InferenceRequest, ParsedBody
from kvswitch.errors import InvalidRequest, grpc_code_for_http, openai_type_for_http
from kvswitch.protocol import headers as h

__all__ = [
    "BODY_CONTINUE", "HEADERS_CONTINUE", "RESPONSE_BODY_CONTINUE", "RESPONSE_HEADERS_CONTINUE",
    "RESPONSE_TRAILERS_CONTINUE", "TRAILERS_CONTINUE", "destination_reply", "header_dict",
    "immediate_error", "inference_request", "parse_usage", "streamed_body",
    "streamed_body_chunks", "subset_hint",
]


# -- reading Envoy's messages ------------------------------------------------------------------


def header_dict(header_map: HeaderMap) -> dict[str, str]:
    """Envoy headers as {lowercase name: value}; Envoy sends `raw_value` (bytes) by default."""
    # latin-1 never fails: header bytes are opaque octets (RFC 9110), names are ASCII.
    return {x.key: x.raw_value.decode("latin-1") or x.value for x in header_map.headers}


def subset_hint(message: ep.ProcessingRequest, headers: dict[str, str]) -> tuple[str, ...] | None:
    """The proxy's subset hint: `envoy.lb.subset_hint` filter metadata, else the header."""
    namespace = message.metadata_context.filter_metadata.get(h.SUBSET_HINT_NAMESPACE)
    if namespace is not None and h.DESTINATION_SUBSET in namespace.fields:
        value = namespace.fields[h.DESTINATION_SUBSET]
        if value.WhichOneof("kind") == "list_value":
            return tuple(v.string_value for v in value.list_value.values if v.string_value)
        return _split_addresses(value.string_value)
    header = headers.get(h.DESTINATION_SUBSET)
    return None if header is None else _split_addresses(header)


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
    received_at: float,
) -> InferenceRequest:
    for alias, name in h.ALIASES.items():  # the current names win over the old ones
        if alias in headers and name not in headers:
            headers[name] = headers[alias]
    headers.pop(h.DESTINATION_ENDPOINT, None)  # client-supplied: never trusted, never passed on
    return InferenceRequest(
        request_id=request_id,
        protocol="grpc" if grpc else "http",
        path=headers.get(":path", "/").split("?", 1)[0],
        body=parsed,
        objective=headers.get(h.OBJECTIVE) or None,
        fairness_id=headers.get(h.FAIRNESS_ID) or h.DEFAULT_FAIRNESS_ID,
        slo_ttft_ms=_slo(headers, h.SLO_TTFT_MS),
        slo_tpot_ms=_slo(headers, h.SLO_TPOT_MS),
        headers=headers,
        body_size=size,
        received_at=received_at,
    )


def parse_usage(value: str) -> dict[str, int]:
    """`prompt_tokens=12;completion_tokens=64;cached_tokens=0` -> dict; bad items are skipped."""
    usage: dict[str, int] = {}
    for item in value.split(";"):
        key, _, number = item.partition("=")
        number = number.strip()
        if number.isdigit():
            usage[key.strip()] = int(number)
    return usage


# -- building replies --------------------------------------------------------------------------

HEADERS_CONTINUE = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
BODY_CONTINUE = ep.ProcessingResponse(request_body=ep.BodyResponse())
TRAILERS_CONTINUE = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
RESPONSE_HEADERS_CONTINUE = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
RESPONSE_BODY_CONTINUE = ep.ProcessingResponse(response_body=ep.BodyResponse())
RESPONSE_TRAILERS_CONTINUE = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# Envoy's ext_proc client has no small message limit, but keep each echoed chunk modest.
_ECHO_CHUNK_BYTES = 1024 * 1024


def _header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


_TE_TRAILERS = _header("te", "trailers")


# Replies are filled through attribute paths: several times cheaper in upb than nested kwargs.


def destination_reply(destination: str, *, grpc: bool, on_body: bool) -> ep.ProcessingResponse:
    """Route to `destination`: the header (overwriting any client-supplied copy, which is never
    trusted) and the same value under `envoy.lb` dynamic metadata. `on_body`: reply to the last
    body chunk (buffered modes) instead of the request headers."""
    reply = ep.ProcessingResponse()
    common = reply.request_body.response if on_body else reply.request_headers.response
    sets = common.header_mutation.set_headers
    option = sets.add()
    option.header.key = h.DESTINATION_ENDPOINT
    option.header.raw_value = destination.encode()
    option.append_action = _OVERWRITE
    if grpc:  # gRPC upstreams reject requests without `te: trailers`
        sets.append(_TE_TRAILERS)
    reply.dynamic_metadata.fields[h.DESTINATION_METADATA_NAMESPACE].struct_value.fields[
        h.DESTINATION_ENDPOINT
    ].string_value = destination
    return reply


def streamed_body(body: bytes, end: bool, *, response: bool = False) -> ep.ProcessingResponse:
    reply = ep.ProcessingResponse()
    body_reply = reply.response_body if response else reply.request_body
    streamed = body_reply.response.body_mutation.streamed_response
    streamed.body = body
    streamed.end_of_stream = end
    return reply


def streamed_body_chunks(body: bytes, end: bool) -> list[ep.ProcessingResponse]:
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
) -> ep.ProcessingResponse:
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
    return ep.ProcessingResponse(immediate_response=immediate)
