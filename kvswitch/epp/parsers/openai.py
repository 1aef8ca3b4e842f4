"""`openai-parser`: decodes OpenAI-compatible JSON bodies (`/v1/completions`,
`/v1/chat/completions`).

What it extracts for scheduling:
- `prompt`: a string -> `prompt_text`; a list of strings -> joined with "\\n"; a token list ->
  `prompt_token_ids`; a list of token lists -> concatenated (batched prompts share a replica, and
  the first prompt's prefix is what cache affinity keys on).
- `messages` (chat): an approximation of the rendered prompt for prefix matching: each message as
  "role: text\\n", where text concatenates a string `content` or the `text` of its content parts.
- `stream`, `max_completion_tokens` (else `max_tokens`), `model`, `request_id` (vLLM extension).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from kvswitch.epp.contracts import ParsedBody
from kvswitch.errors import InvalidRequest
from kvswitch.limits import json_sampling_counts

__all__ = ["PATHS", "TYPE", "OpenAIParser", "create"]

TYPE = "openai-parser"
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
PATHS = frozenset({COMPLETIONS, CHAT_COMPLETIONS})


class OpenAIParser:
    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    def matches(self, path: str, content_type: str) -> bool:
        return path in PATHS

    def parse(self, path: str, headers: Mapping[str, str], body: bytes) -> ParsedBody:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise InvalidRequest("request body must be a JSON object")
        token_ids: tuple[int, ...] | None = None
        text: str | None = None
        if path == CHAT_COMPLETIONS:
            text = _messages_text(data.get("messages"))
        else:
            text, token_ids = _prompt(data.get("prompt"))
        return ParsedBody(
            model=_optional(data, "model", str),
            prompt_token_ids=token_ids,
            prompt_text=text,
            stream=bool(_optional(data, "stream", bool)),
            max_tokens=_max_tokens(data),
            request_id=_optional(data, "request_id", str),
            sampling=json_sampling_counts(data),
        )


def _optional(data: Mapping[str, Any], key: str, kind: type) -> Any:
    value = data.get(key)
    # bool is an int subclass: never accept it where a count is expected.
    if value is None or (type(value) is kind):
        return value
    raise InvalidRequest(f"'{key}' must be a {kind.__name__}", param=key)


_MAX_TOKEN_ID = 2**32 - 1


def _max_tokens(data: Mapping[str, Any]) -> int | None:
    value: int | None = _optional(data, "max_completion_tokens", int)
    if value is None:
        value = _optional(data, "max_tokens", int)
    return value


def _is_tokens(value: list[Any]) -> bool:
    # Token ids are uint32 on the engine API (and the prefix index packs them as such).
    return all(type(t) is int and 0 <= t <= _MAX_TOKEN_ID for t in value)


def _prompt(prompt: Any) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt), None
        if _is_tokens(prompt):
            return None, tuple(prompt)
        if all(isinstance(p, list) and _is_tokens(p) for p in prompt):
            return None, tuple(t for p in prompt for t in p)
    raise InvalidRequest(
        "'prompt' must be a string, a list of strings, or a list (or lists) of token ids",
        param="prompt",
    )


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise InvalidRequest("each message must be an object", param="messages")
        parts.append(f"{message.get('role', '')}: {_content_text(message.get('content'))}\n")
    return "".join(parts)


def _content_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    raise InvalidRequest("message 'content' must be a string or a list of parts", param="messages")


def create(name: str, parameters: Mapping[str, Any], handle: Any) -> OpenAIParser:
    return OpenAIParser(name)
