"""The ext_proc request path as a sans-IO state machine: one `ExtProcStream` per Envoy stream.

    stream.receive(ProcessingRequest) -> [SerializedResponse | NeedRouting | RequestFinished]
    stream.routed(RoutingDecision)     -> [SerializedResponse | RequestFinished]
    stream.close()                     -> [RequestFinished]     (the gRPC stream ended)

The driver (`kvswitch.epp.server`) sends responses (ProcessingResponses already serialized:
`bytes`), resolves `NeedRouting` with `router.route()` and hands `RequestFinished` to
`router.request_finished()`.

Envoy's request body mode decides the reply order (it arrives in `protocol_config`):
- FULL_DUPLEX_STREAMED (default): Envoy streams the body without waiting for the headers
  reply, so the headers reply is held until the body is parsed and routed; it then carries the
  destination, and the body is echoed back as `streamed_response` (else the upstream gets none).
- BUFFERED / STREAMED: the headers are answered at once; the reply to the last body chunk
  carries the destination.
Requests no parser claims (or whose parser needs no body) are routed on their headers.

Response side: at most response headers and trailers (never the body: docs/architecture.md).
kvswitch's own bootstrap sends none (the access log reports each request's end:
`kvswitch.epp.access_log`); other gateways may send both. They
yield the status and the usage trailer. The routed request is reported finished exactly once:
at its trailers or at headers with end_of_stream (`seen_end`), or at `close()` (not `seen_end`:
the router may wait for the request's log entry).
Nothing here raises on input: a malformed request becomes an ImmediateResponse for its stream.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from kvswitch.epp.contracts import (
    EndpointPicker,
    InferenceRequest,
    ParsedBody,
    Parser,
    RequestOutcome,
    RoutingDecision,
    response_ok,
)
from kvswitch.epp.extproc_messages import (
    BODY_CONTINUE,
    HEADERS_CONTINUE,
    RESPONSE_BODY_CONTINUE,
    RESPONSE_HEADERS_CONTINUE,
    RESPONSE_TRAILERS_CONTINUE,
    TRAILERS_CONTINUE,
    SerializedResponse,
    destination_reply,
    gateway_metadata,
    header_dict,
    immediate_error,
    inference_request,
    response_status,
    streamed_body,
    streamed_body_chunks,
)
from kvswitch.epp.parsers import needs_body, select_parser
from kvswitch.errors import InternalError, InvalidRequest, KvswitchError, PayloadTooLarge
from kvswitch.limits import check_sampling
from kvswitch.protocol import headers as h

__all__ = ["Action", "ExtProcStream", "NeedRouting", "RequestFinished", "SerializedResponse"]

logger = logging.getLogger(__name__)

_FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
_EMPTY_BODY = ParsedBody()
_NO_USAGE: dict[str, int] = {}


@dataclass(slots=True)  # internal and made per request: not frozen (cheaper __init__)
class NeedRouting:
    """Ask the router where `request` goes; feed the answer to `ExtProcStream.routed()`."""

    request: InferenceRequest
    subset: tuple[str, ...] | None
    """The proxy's subset hint (None: no hint, pick from the whole pool)."""


@dataclass(slots=True)  # internal and made per request: not frozen (cheaper __init__)
class RequestFinished:
    """A routed request ended: pass to `router.request_finished()`."""

    request: InferenceRequest
    outcome: RequestOutcome


Action: TypeAlias = SerializedResponse | NeedRouting | RequestFinished
"""What a stream asks of its driver; a `SerializedResponse` is `bytes` at run time."""


class _Phase(Enum):
    HEADERS = "awaiting request headers"
    BODY = "reading request body"
    ROUTING = "awaiting routing decision"
    FORWARDING = "forwarding"
    DONE = "done"


# Module globals: `_Phase.BODY` is a class attribute lookup through EnumType (~0.1 us each,
# about ten per request).
_HEADERS, _BODY, _ROUTING, _FORWARDING, _DONE = _Phase


class ExtProcStream:
    """One ext_proc stream, i.e. one HTTP request through Envoy."""

    # Immutable starting values live on the class: one is made per request, and an instance
    # only stores what changes (≈ 0.5 us less per stream than setting them all in __init__).
    _phase = _HEADERS
    _grpc = False
    _parser_needs_body = False
    _size = 0
    _body_messages = 0
    _body_ended = False
    _request_trailers = False
    _received_at = 0.0
    _path = "/"
    _parser: Parser | None = None
    _subset: tuple[str, ...] | None = None
    _access_logged = False
    request: InferenceRequest | None = None
    endpoints: tuple[str, ...] = ()
    _routed = False
    _finished = False
    _http_status: int | None = None
    _grpc_status: int | None = None
    _usage: dict[str, int] | None = None

    def __init__(
        self,
        picker: EndpointPicker,
        *,
        default_body_mode: int = _FULL_DUPLEX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._picker = picker
        self._body_mode = default_body_mode
        self._full_duplex = default_body_mode == _FULL_DUPLEX
        self._clock = clock
        self._headers: dict[str, str] = {}
        self._chunks: list[bytes] = []

    @property
    def full_duplex(self) -> bool:
        return self._full_duplex

    # -- input ------------------------------------------------------------------------------

    def receive(self, message: ep.ProcessingRequest) -> list[Action]:
        """Feed one message from Envoy; never raises."""
        if self._phase is _DONE:  # after a local reply Envoy has nothing more to ask
            return []
        try:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                return self._on_request_headers(message)
            if kind == "request_body":
                return self._on_request_body(message.request_body)
            if kind == "request_trailers":
                return self._on_request_trailers()
            if kind == "response_headers":
                return self._on_response_headers(message.response_headers)
            if kind == "response_trailers":
                return self._on_response_trailers(message.response_trailers)
            if kind == "response_body":
                return self._on_response_body(message.response_body)
            raise InvalidRequest(f"unexpected ext_proc message {kind!r}")
        except KvswitchError as exc:
            return self._fail(exc)
        except Exception as exc:  # a bug must cost one request, not the stream task
            logger.exception("ext_proc stream failed on %s", message.WhichOneof("request"))
            return self._fail(InternalError(f"endpoint picker error: {exc}"))

    def routed(self, decision: RoutingDecision) -> list[Action]:
        """The router's answer to the last `NeedRouting`; never raises."""
        if self._phase is not _ROUTING or self.request is None:
            return []
        if decision.status != 200 or not decision.endpoints:
            status = decision.status if decision.status != 200 else 503
            reason = decision.reason or "no endpoint picked"
            return self._reply_error(status, reason, reason)
        self._routed = True
        self.endpoints = decision.endpoints
        self._phase = _FORWARDING
        destination = ",".join(decision.endpoints)
        if not self._full_duplex and self._parser_needs_body:
            # Buffered: the headers were answered already; the body reply carries the pick.
            return [destination_reply(destination, grpc=self._grpc, on_body=True,
                                      replica=self._picker.replica_name)]
        out: list[Action] = [destination_reply(destination, grpc=self._grpc, on_body=False,
                                               replica=self._picker.replica_name)]
        if self._full_duplex:
            out.extend(self._echo_body())
        elif self._chunks:
            out.append(BODY_CONTINUE)
        return out

    def close(self) -> list[Action]:
        """The gRPC stream ended (end of request, client cancel, upstream reset, or Envoy done
        with a request whose response it does not show the EPP)."""
        out = self._finish(seen_end=False) if self._routed and not self._finished else []
        self._phase = _DONE
        return out

    # -- request side ------------------------------------------------------------------------

    def _on_request_headers(self, message: ep.ProcessingRequest) -> list[Action]:
        if self._phase is not _HEADERS:
            raise InvalidRequest("request headers received twice")
        if message.HasField("protocol_config"):
            self._body_mode = message.protocol_config.request_body_mode
            self._full_duplex = self._body_mode == _FULL_DUPLEX
        self._received_at = self._clock()
        request_headers = message.request_headers
        headers = self._headers = header_dict(request_headers.headers)
        content_type = headers.get("content-type", "")
        self._grpc = content_type.startswith("application/grpc")
        length = headers.get("content-length")
        if length and not length.isdigit():
            raise InvalidRequest(f"content-length {length[:32]!r} is not a number")
        if length and int(length) > self._picker.max_body_bytes:
            raise _too_large(self._picker.max_body_bytes)
        path = self._path = headers.get(":path", "/").split("?", 1)[0]
        parser = select_parser(self._picker.parsers, path, content_type)
        self._body_ended = request_headers.end_of_stream
        self._parser_needs_body = needs_body(parser) and not self._body_ended
        self._access_logged, self._subset = gateway_metadata(message, headers)
        if not self._parser_needs_body:
            return self._need_routing(_EMPTY_BODY)
        self._parser = parser
        self._phase = _BODY
        return [] if self._full_duplex else [HEADERS_CONTINUE]

    def _on_request_body(self, body: ep.HttpBody) -> list[Action]:
        if self._body_ended:
            raise InvalidRequest("request body after end of stream")
        data = body.body  # upb copies a bytes field on every read
        self._size += len(data)
        self._body_messages += 1
        if self._size > self._picker.max_body_bytes:
            raise _too_large(self._picker.max_body_bytes)
        self._body_ended = body.end_of_stream or body.end_of_stream_without_message
        if self._phase is _FORWARDING:  # routed on headers: stream it straight through
            if self._full_duplex:
                return [streamed_body(data, self._body_ended)]
            return [BODY_CONTINUE]
        if data:
            self._chunks.append(data)
        if self._phase is _BODY and self._body_ended:
            return self._parse_and_route()
        if not self._full_duplex and self._phase is _BODY:
            return [BODY_CONTINUE]  # STREAMED mode answers every chunk
        return []

    def _on_request_trailers(self) -> list[Action]:
        self._request_trailers = True
        if self._phase is _BODY and not self._body_ended:
            self._body_ended = True
            return self._parse_and_route()
        if self._phase is _FORWARDING:
            return [TRAILERS_CONTINUE]
        return []  # answered with the body echo once routed

    def _parse_and_route(self) -> list[Action]:
        body = b"".join(self._chunks)
        self._chunks = [body] if body else []
        assert self._parser is not None
        parsed = self._parser.parse(self._path, self._headers, body)
        if parsed.sampling is not None:
            check_sampling(parsed.sampling, self._picker.sampling_limits)
        return self._need_routing(parsed)

    def _need_routing(self, parsed: ParsedBody) -> list[Action]:
        headers = self._headers
        request_id = headers.get(h.REQUEST_ID) or parsed.request_id or uuid.uuid4().hex
        self.request = inference_request(
            headers, parsed, request_id, grpc=self._grpc, size=self._size,
            received_at=self._received_at, path=self._path, access_logged=self._access_logged,
        )
        if self._subset is not None and not self._subset:
            reason = "subset hint lists no endpoints"
            return self._reply_error(503, reason, reason)
        self._phase = _ROUTING
        return [NeedRouting(self.request, self._subset)]

    def _echo_body(self) -> list[Action]:
        """Full duplex: give Envoy back the body it streamed to us (and the trailers reply)."""
        out: list[Action] = []
        if self._body_messages:  # a header-only request gets no body reply (Envoy: spurious)
            body = b"".join(self._chunks)
            end = self._body_ended and not self._request_trailers
            out.extend(streamed_body_chunks(body, end))
        self._chunks = []
        if self._request_trailers:
            out.append(TRAILERS_CONTINUE)
        return out

    # -- response side -----------------------------------------------------------------------

    def _on_response_headers(self, headers_msg: ep.HttpHeaders) -> list[Action]:
        status, self._grpc_status, self._usage = response_status(
            headers_msg.headers, self._grpc_status, self._usage)
        self._http_status = int(status) if status and status.isdigit() else None
        if headers_msg.end_of_stream:
            return [RESPONSE_HEADERS_CONTINUE, *self._finish()]
        return [RESPONSE_HEADERS_CONTINUE]

    def _on_response_body(self, body: ep.HttpBody) -> list[Action]:
        # Not configured (response_body NONE); answered correctly anyway.
        out: list[Action]
        if self._full_duplex:
            out = [streamed_body(body.body, body.end_of_stream, response=True)]
        else:
            out = [RESPONSE_BODY_CONTINUE]
        return out

    def _on_response_trailers(self, trailers: ep.HttpTrailers) -> list[Action]:
        _, self._grpc_status, self._usage = response_status(
            trailers.trailers, self._grpc_status, self._usage)
        return [RESPONSE_TRAILERS_CONTINUE, *self._finish()]

    def _finish(self, seen_end: bool = True) -> list[Action]:
        if not self._routed or self._finished or self.request is None:
            return []
        self._finished = True
        usage = self._usage or _NO_USAGE
        outcome = RequestOutcome(
            endpoint=self.endpoints[0],
            ok=response_ok(self._grpc, self._grpc_status, self._http_status),
            grpc_status=self._grpc_status,
            http_status=self._http_status,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            cached_tokens=usage.get("cached_tokens"),
            seen_end=seen_end,
        )
        return [RequestFinished(self.request, outcome)]

    # -- errors ------------------------------------------------------------------------------

    def _fail(self, exc: KvswitchError) -> list[Action]:
        if self._phase is _DONE:
            return []
        if self._http_status is not None:
            # The response has started; a local reply is no longer possible.
            logger.warning("ext_proc error after response started: %s", exc.message)
            return []
        reason = type(exc).__name__
        return self._reply_error(exc.http_status, exc.message, reason, param=exc.param)

    def _reply_error(
        self, status: int, message: str, reason: str, *, param: str | None = None
    ) -> list[Action]:
        if status >= 500:
            logger.warning("request dropped (%d): %s", status, message)
        else:
            logger.debug("request rejected (%d): %s", status, message)
        self._phase = _DONE
        reply = immediate_error(status, message, reason, grpc=self._grpc, param=param)
        # A request routed on its headers and failed later still reports its end.
        return [reply, *self._finish()]


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body exceeds the endpoint picker's {limit}-byte limit")
