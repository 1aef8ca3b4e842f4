"""Anthropic Messages request models, and their translation into a chat completion request.

`/v1/messages` runs on the chat path: `to_chat_request` maps the system prompt, text,
`tool_use` / `tool_result` and `thinking` blocks onto OpenAI messages (tool results become
`role: tool` messages, tool uses an assistant's `tool_calls`), `tools[].input_schema` onto
function parameters, `tool_choice` (auto, any -> required, tool -> named, none,
`disable_parallel_tool_use`), `stop_sequences`, `thinking` (-> `enable_thinking`: on only
when enabled, as in Anthropic's API; `budget_tokens` >= 1024 and below max_tokens, but not
enforced on the output) and `metadata.user_id` (-> `user`). Images, documents and server tools
are a 400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from kvswitch.errors import InvalidRequest
from kvswitch.frontend.openai_models import (
    ChatCompletionRequest,
    RequestBody,
    StrictModel,
    parse_request,
)

__all__ = ["MessagesRequest", "to_chat_request"]


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                  Field(discriminator="type")]


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(StrictModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(StrictModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1024)] | None = None


class Metadata(StrictModel):
    user_id: str | None = None


class MessagesRequest(RequestBody):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None

    def check(self) -> None:
        thinking = self.thinking
        if thinking is not None and thinking.type == "enabled":
            if thinking.budget_tokens is None:
                raise InvalidRequest("thinking.budget_tokens is required when thinking is "
                                     "enabled", param="thinking.budget_tokens")
            if thinking.budget_tokens >= self.max_tokens:
                raise InvalidRequest("max_tokens must be greater than thinking.budget_tokens",
                                     param="max_tokens")


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def _messages(request: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _text(request.system)
    if system:
        out.append({"role": "system", "content": system})
    for message in request.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        thinking: list[str] = []
        for block in message.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ThinkingBlock):
                thinking.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input,
                                                                ensure_ascii=False)}})
            else:  # a tool result: its own `role: tool` message, in order
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": _text(block.content)})
        if texts or calls or thinking:
            entry: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            if thinking:
                entry["reasoning_content"] = "".join(thinking)
            out.append(entry)
    return out


def to_chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves a Messages request."""
    body: dict[str, Any] = {"model": request.model, "messages": _messages(request),
                            "max_tokens": request.max_tokens, "stream": request.stream}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    if request.stop_sequences:
        body["stop"] = request.stop_sequences
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if choice.type == "tool" else
                               {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    # As in Anthropic's API (and SMG), the model thinks only when asked to.
    thinking = request.thinking is not None and request.thinking.type == "enabled"
    body["chat_template_kwargs"] = {"enable_thinking": thinking}
    if request.metadata is not None and request.metadata.user_id:
        body["user"] = request.metadata.user_id
    return parse_request(ChatCompletionRequest, body)
