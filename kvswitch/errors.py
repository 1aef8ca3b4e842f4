"""One error tree for kvswitch, and the table that maps it across protocols.

Every error a user can meet carries three faces: a gRPC status code (engine API, EPP local
replies to gRPC calls), an HTTP status (OpenAI API, EPP local replies to HTTP calls) and an
OpenAI error `type`. Lower layers raise these; boundaries translate foreign exceptions into them
(`raise InvalidRequest(...) from exc`) and render them with the table below.
"""

from __future__ import annotations

import grpc

__all__ = [
    "GRPC_TO_HTTP",
    "Cancelled",
    "DeadlineExceeded",
    "HeadersTooLarge",
    "InternalError",
    "InvalidRequest",
    "KvswitchError",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "RequestTimeout",
    "Unavailable",
    "Unimplemented",
    "UriTooLong",
    "grpc_code_for_http",
    "http_status_for_grpc",
    "openai_type_for_http",
]


class KvswitchError(Exception):
    """Base of every error kvswitch raises on purpose."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # The request field at fault, reported as OpenAI's `param`.
        self.param = param


class InvalidRequest(KvswitchError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class NotFound(KvswitchError):
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class PayloadTooLarge(KvswitchError):
    # gRPC reports an oversize message as RESOURCE_EXHAUSTED; HTTP has a status of its own.
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


class HeadersTooLarge(KvswitchError):
    # An HTTP request head over the server's limits (size or field count).
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 431


class UriTooLong(KvswitchError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 414


class RateLimited(KvswitchError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class Unavailable(KvswitchError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class DeadlineExceeded(KvswitchError):
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class RequestTimeout(KvswitchError):
    # The client stopped sending a request half-way (HTTP 408); the gateway's own deadline is
    # DeadlineExceeded.
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 408


class Cancelled(KvswitchError):
    grpc_code = grpc.StatusCode.CANCELLED
    http_status = 499


class Unimplemented(KvswitchError):
    grpc_code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 501


class InternalError(KvswitchError):
    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500


# gRPC status -> HTTP status, as grpc-gateway and Envoy's grpc_json_transcoder map them.
GRPC_TO_HTTP: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNAUTHENTICATED: 401,
}

# HTTP status -> gRPC status for replies kvswitch itself makes to gRPC callers (EPP local
# replies). The inverse of the table above on the statuses it produces.
_HTTP_TO_GRPC: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    414: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    431: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

_OPENAI_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "TimeoutError",
    409: "ConflictError",
    413: "BadRequestError",
    414: "BadRequestError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    431: "BadRequestError",
    499: "ClientClosedRequest",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


def http_status_for_grpc(code: grpc.StatusCode) -> int:
    return GRPC_TO_HTTP.get(code, 500)


def grpc_code_for_http(status: int) -> grpc.StatusCode:
    return _HTTP_TO_GRPC.get(status, grpc.StatusCode.INTERNAL if status >= 500
                             else grpc.StatusCode.UNKNOWN)


def openai_type_for_http(status: int) -> str:
    """The `type` of an OpenAI error body, named as vLLM's OpenAI server names it."""
    return _OPENAI_TYPES.get(status, "InternalServerError")
