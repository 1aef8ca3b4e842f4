"""Server-sent events for streamed responses, and OpenAI error bodies.

`sse_reply` wraps an async iterator of SSE-framed bytes (ending with `data: [DONE]`) as the
server's `StreamReply`: the event that ends with [DONE] is the last one (the last content, usage
and [DONE] go out in one write). An error raised by the iterator after the 200 has gone out can
only travel in-band: an SSE `data: {"error": ...}` event, then `data: [DONE]`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from kvswitch.errors import InternalError, KvswitchError, openai_type_for_http
from kvswitch.frontend.generation import ChoiceDelta, Generation
from kvswitch.frontend.http_server import Reply, StreamReply

__all__ = [
    "CHUNK_END",
    "DONE",
    "choice_events",
    "chunk_start",
    "error_body",
    "error_reply",
    "sse_error_event",
    "sse_reply",
]

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
CHUNK_END = b"]}\n\n"


def chunk_start(head: bytes) -> bytes:
    """`data: {...head fields,"choices":[` — a chunk event is this + choice JSON + CHUNK_END."""
    return b"data: " + head[:-1] + b',"choices":['


async def choice_events(deltas: AsyncIterator[ChoiceDelta], generation: Generation, head: bytes,
                        lead: bytes,
                        choice_of: Callable[[ChoiceDelta], dict[str, Any] | None],
                        include_usage: bool, on_end: Callable[[Generation], None]
                        ) -> AsyncIterator[bytes]:
    """A streamed response's SSE events: one chunk per delta (`choice_of` builds its choice, or
    None to send nothing for it; vLLM's `stop_reason` is added on the finishing one). `lead`
    (role or echo chunks) rides with the first event, and the deltas that finish the generation ride
    with the usage chunk (`stream_options.include_usage`) and [DONE] in one last write. `head` is
    the chunk object's JSON without choices; `on_end` runs once the deltas are done."""
    start, dumps = chunk_start(head), orjson.dumps
    tail = b""
    async for delta in deltas:
        choice = choice_of(delta)
        if choice is None:
            continue
        if delta.finish_reason is not None:
            choice["stop_reason"] = delta.stop_reason
        event = lead + start + dumps(choice) + CHUNK_END
        lead = b""
        if generation.finished:
            tail += event
        else:
            yield event
    on_end(generation)
    if include_usage:
        tail += (b"data: " + head[:-1] + b',"choices":[],"usage":'
                 + dumps(generation.usage.as_dict()) + b"}\n\n")
    yield lead + tail + DONE


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
