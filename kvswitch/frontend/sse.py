"""Server-sent events for streamed responses, and OpenAI error bodies.

`sse_reply` wraps an async iterator of SSE-framed bytes (ending with `data: [DONE]`) as the
server's `StreamReply`: the event that ends with [DONE] is the last one (the last content, usage
and [DONE] go out in one write). An error raised by the iterator after the 200 has gone out can
only travel in-band: an SSE `data: {"error": ...}` event, then `data: [DONE]`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson

from kvswitch.errors import InternalError, KvswitchError, openai_type_for_http
from kvswitch.frontend.http_server import Reply, StreamReply

__all__ = ["DONE", "error_body", "error_reply", "sse_error_event", "sse_reply"]

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def error_body(error: KvswitchError) -> dict[str, Any]:
    """OpenAI's error object, with vLLM's `type` names and the HTTP status as `code`."""
    return {"error": {"message": error.message, "type": openai_type_for_http(error.http_status),
                      "param": error.param, "code": error.http_status}}


def error_reply(error: KvswitchError) -> Reply:
    return Reply(error.http_status, orjson.dumps(error_body(error)))


def sse_error_event(error: KvswitchError) -> bytes:
    return b"data: " + orjson.dumps(error_body(error)) + b"\n\n"


def _in_band(exc: Exception) -> bytes:
    """The error event and [DONE] that end a stream whose iterator raised."""
    if not isinstance(exc, KvswitchError):
        logger.error("stream failed", exc_info=exc)
        exc = InternalError(f"internal error: {exc}")
    return sse_error_event(exc) + DONE


def sse_reply(events: AsyncIterator[bytes]) -> StreamReply:
    return StreamReply(events, last=DONE, on_error=_in_band)
