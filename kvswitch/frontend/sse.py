"""Server-sent events for streamed responses, and OpenAI error bodies.

`SSEResponse` is a minimal ASGI response that sends each item of an async iterator of bytes as
it comes, and watches for the client going away: a disconnect cancels the iterator at once (so
the Generate call behind it is cancelled and the engine frees the request), rather than when
the next token fails to send. An event that already ends with `data: [DONE]` ends the stream
(the last content, usage and [DONE] go out in one write). An error raised by the iterator after the 200 has gone out can
only travel in-band: an SSE `data: {"error": ...}` event, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvswitch.errors import InternalError, KvswitchError, openai_type_for_http

__all__ = ["DONE", "SSEResponse", "error_body", "error_response"]

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


def error_body(error: KvswitchError) -> dict[str, Any]:
    """OpenAI's error object, with vLLM's `type` names and the HTTP status as `code`."""
    return {"error": {"message": error.message, "type": openai_type_for_http(error.http_status),
                      "param": error.param, "code": error.http_status}}


def error_response(error: KvswitchError) -> Response:
    return Response(orjson.dumps(error_body(error)), status_code=error.http_status,
                    media_type="application/json")


def sse_error_event(error: KvswitchError) -> bytes:
    return b"data: " + orjson.dumps(error_body(error)) + b"\n\n"


class SSEResponse:
    """Streams `events` (already framed as SSE bytes) and ends with `data: [DONE]`."""

    def __init__(self, events: AsyncIterator[bytes], headers: list[tuple[bytes, bytes]]
                 | None = None) -> None:
        self._events = events
        self._headers = _HEADERS + (headers or [])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = asyncio.Event()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                    task.cancel()
                    return

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self._headers})
            await self._stream(send)
        except asyncio.CancelledError:
            if not gone.is_set():
                raise
            # The client left: the iterator is closed below, which cancels its Generate call.
            task.uncancel()
        except OSError:
            pass  # the connection broke while sending
        finally:
            watcher.cancel()
            await self._events.aclose()  # type: ignore[attr-defined]

    async def _stream(self, send: Send) -> None:
        try:
            async for event in self._events:
                if event.endswith(DONE):
                    await send({"type": "http.response.body", "body": event, "more_body": False})
                    return
                await send({"type": "http.response.body", "body": event, "more_body": True})
        except KvswitchError as error:
            await send({"type": "http.response.body", "body": sse_error_event(error),
                        "more_body": True})
        except (asyncio.CancelledError, OSError):
            raise
        except Exception as exc:
            logger.exception("stream failed")
            await send({"type": "http.response.body",
                        "body": sse_error_event(InternalError(f"internal error: {exc}")),
                        "more_body": True})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})
