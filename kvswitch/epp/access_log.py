"""How requests ended, read from Envoy's gRPC access log (sans-IO).

kvswitch's Envoy bootstrap streams its access log to the EPP (`envoy.access_loggers.http_grpc`,
the `envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs` call) and tells the ext_proc
filter to skip gRPC responses' trailers. The ext_proc stream then closes once the request is
routed, so:
- neither the response's end nor an EPP restart waits on, or breaks, a response in flight;
- the EPP learns each request's end from its log entry instead: status, usage trailer and
  duration, batched by Envoy (one message per flush interval or buffer, not one round trip per
  request). The router keeps the request's in-flight count until then.

`ended_requests(message)` reads one `StreamAccessLogsMessage` into `LoggedEnd`s, which the
router (an `AccessLogSink`) turns into outcomes. An entry's `x-request-id` is the id the EPP saw
in the request's headers (Envoy generates one when the client sends none). Intermediate entries
(Envoy's periodic logs of long streams) are skipped: only a stream's final entry says how it
ended.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from envoy.service.accesslog.v3 import als_pb2

from kvswitch.epp.extproc_messages import parse_usage
from kvswitch.protocol import headers as h

__all__ = ["SERVICE_PATH", "AccessLogSink", "LoggedEnd", "ended_requests"]

SERVICE_PATH = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
_NO_USAGE: dict[str, int] = {}


class LoggedEnd(NamedTuple):
    """How one request ended, by its log entry; the router judges `ok` (it knows whether the
    request was gRPC)."""

    request_id: str
    grpc_status: int | None
    """From the response trailers, or the headers of a trailers-only reply; None: none sent."""
    http_status: int | None
    """The response code Envoy sent downstream; None: no response (e.g. the client left)."""
    usage: dict[str, int]
    """The usage trailer, parsed (empty: none)."""
    duration: float | None
    """Seconds from the request's first byte to the stream's end, by Envoy's clock."""


@runtime_checkable
class AccessLogSink(Protocol):
    """What takes the entries (the router): the EPP serves the access-log service only then."""

    def request_logged(self, end: LoggedEnd) -> None: ...
    def access_log_opened(self) -> None: ...
    def access_log_closed(self) -> None:
        """A log stream ended; with none left, requests still waiting will get no entry."""


def ended_requests(message: bytes) -> list[LoggedEnd]:
    """One `StreamAccessLogsMessage`'s final HTTP entries; raises DecodeError."""
    parsed = als_pb2.StreamAccessLogsMessage.FromString(message)
    if not parsed.HasField("http_logs"):  # TCP logs: not ours
        return []
    out: list[LoggedEnd] = []
    for entry in parsed.http_logs.log_entry:
        common = entry.common_properties
        request_id = entry.request.request_id
        if common.intermediate_log_entry or not request_id:
            continue
        response = entry.response
        trailers = response.response_trailers  # (one map wrapper for both reads)
        code = trailers.get("grpc-status") or response.response_headers.get("grpc-status")
        usage = trailers.get(h.USAGE_TRAILER)
        out.append(LoggedEnd(
            request_id,
            int(code) if code and code.isdigit() else None,
            response.response_code.value or None,  # unset reads 0: no response either
            parse_usage(usage) if usage else _NO_USAGE,
            common.duration.ToNanoseconds() / 1e9 if common.HasField("duration") else None,
        ))
    return out
