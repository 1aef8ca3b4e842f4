"""/v1/messages: Anthropic's Messages API on the chat completion path.

The request becomes a chat completion request (`anthropic_protocol.to_chat_request`), runs
through `ChatServing.start` (template, tokenization, Generate, the reasoning and tool-call
parsers) and is shaped as Anthropic's `message`: content blocks `thinking`, `text`,
`tool_use`; `stop_reason` end_turn / max_tokens / stop_sequence / tool_use. Streamed, the SSE
events are message_start, content_block_start / _delta (text_delta, thinking_delta,
input_json_delta) / _stop per block, message_delta (stop reason, output tokens), message_stop.
Errors use Anthropic's body: `{"type": "error", "error": {"type", "message"}}`.
/v1/messages/count_tokens answers `{"input_tokens"}` for the same request body.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from kvswitch.errors import InternalError, KvswitchError
from kvswitch.frontend.anthropic_protocol import MessagesRequest, to_chat_request
from kvswitch.frontend.generation import ChoiceDelta, prime
from kvswitch.frontend.http_server import Reply, StreamReply
from kvswitch.frontend.openai_models import parse_request
from kvswitch.frontend.parsing import ParsedDelta
from kvswitch.frontend.serving_chat import ChatRun, ChatServing, finish_reason_of
from kvswitch.frontend.serving_models import ModelRegistry

__all__ = ["MESSAGE_STOP", "MessagesServing", "anthropic_error_reply", "anthropic_stream_reply"]

MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 504: "api_error"}


def _error_body(error: KvswitchError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.http_status, "api_error"),
                                       "message": error.message}}


def anthropic_error_reply(error: KvswitchError) -> Reply:
    return Reply(error.http_status, orjson.dumps(_error_body(error)))


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _in_band(exc: Exception) -> bytes:
    error = exc if isinstance(exc, KvswitchError) else InternalError(f"internal error: {exc}")
    return _event("error", _error_body(error))


def anthropic_stream_reply(events: AsyncIterator[bytes]) -> StreamReply:
    return StreamReply(events, last=MESSAGE_STOP, on_error=_in_band)


def _stop(finish_reason: str | None, stop_reason: str | int | None,
          stop_sequences: list[str]) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for an OpenAI finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
        return {}
    return value if isinstance(value, dict) else {"value": value}


class MessagesServing:
    def __init__(self, chat: ChatServing, models: ModelRegistry) -> None:
        self._chat = chat
        self._models = models

    async def create(self, body: Any, headers: Mapping[str, str]
                     ) -> dict[str, Any] | AsyncIterator[bytes]:
        request = parse_request(MessagesRequest, body)
        chat = to_chat_request(request)
        run = await self._chat.start(chat, headers, prefix="msg")
        stops = request.stop_sequences or []
        if request.stream:
            deltas = await prime(run.generation.deltas())
            return self._stream(deltas, run, stops)
        return self._message(await self._chat.full(run), run, stops)

    async def count_tokens(self, body: Any, headers: Mapping[str, str]) -> dict[str, Any]:
        """/v1/messages/count_tokens: the prompt's length, as the request would be sent."""
        if isinstance(body, dict):
            body = {"max_tokens": 1, **body}  # this route takes no max_tokens
        chat = to_chat_request(parse_request(MessagesRequest, body))
        model = await self._models.resolve(chat.model)
        return {"input_tokens": len(await ChatServing.prompt_ids(chat, model))}

    @staticmethod
    def _message(full: dict[str, Any], run: ChatRun, stops: list[str]) -> dict[str, Any]:
        choice = full["choices"][0]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"],
                            "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            content.append({"type": "tool_use", "id": call["id"],
                            "name": call["function"]["name"],
                            "input": _input(call["function"]["arguments"])})
        stop_reason, stop_sequence = _stop(choice["finish_reason"], choice["stop_reason"],
                                           stops)
        usage = full["usage"]
        return {"id": run.ctx.request_id, "type": "message", "role": "assistant",
                "model": run.model.name, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": {"input_tokens": usage["prompt_tokens"],
                          "output_tokens": usage["completion_tokens"],
                          "cache_read_input_tokens":
                              usage["prompt_tokens_details"]["cached_tokens"]}}

    async def _stream(self, deltas: AsyncIterator[ChoiceDelta], run: ChatRun,
                      stops: list[str]) -> AsyncIterator[bytes]:
        generation = run.generation
        output = run.plan.new_choice() if run.plan.new_choice is not None else None
        blocks = _Blocks()
        head: bytes | None = None
        async for delta in deltas:
            if head is None:
                head = _event("message_start", {"type": "message_start", "message": {
                    "id": run.ctx.request_id, "type": "message", "role": "assistant",
                    "model": run.model.name, "content": [], "stop_reason": None,
                    "stop_sequence": None, "usage": {
                        "input_tokens": generation.usage.prompt_tokens, "output_tokens": 0}}})
                yield head
            if output is None:
                parsed = ParsedDelta(content=delta.text)
            else:
                parsed = output.feed(delta.text)
                if delta.finish_reason is not None:
                    parsed.extend(output.finish())
            events = blocks.events(parsed)
            if delta.finish_reason is not None:
                reason = delta.finish_reason if output is None else \
                    finish_reason_of(delta.finish_reason, output, run.plan)
                stop_reason, stop_sequence = _stop(reason, delta.stop_reason, stops)
                events += blocks.close() + _event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": generation.usage.completion_tokens}})
            if events:
                yield events
        self._chat.record(generation)
        yield MESSAGE_STOP


class _Blocks:
    """Content blocks of a streamed message: a new block whenever the kind of output changes
    (thinking, text, one per tool call)."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.call = -1

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self.close()
        self.index += 1
        self.kind = kind
        return out + _event("content_block_start", {"type": "content_block_start",
                                                     "index": self.index,
                                                     "content_block": block})

    def close(self) -> bytes:
        if self.kind is None:
            return b""
        self.kind = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta",
                                              "index": self.index, "delta": delta})

    def events(self, parsed: ParsedDelta) -> bytes:
        out = b""
        if parsed.reasoning:
            if self.kind != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "",
                                               "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": parsed.reasoning})
        if parsed.content:
            if self.kind != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": parsed.content})
        for call in parsed.calls:
            if call.id is not None or self.kind != "tool_use" or call.index != self.call:
                self.call = call.index
                out += self._open("tool_use", {"type": "tool_use", "id": call.id,
                                               "name": call.name, "input": {}})
            if call.arguments:
                out += self._delta({"type": "input_json_delta",
                                    "partial_json": call.arguments})
        return out
