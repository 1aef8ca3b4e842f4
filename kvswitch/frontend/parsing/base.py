"""Contracts for turning a model's raw text into OpenAI's message fields, and their registries.

Both parsers are sans-IO and incremental: `feed(text)` takes the next piece of the decoded
output and returns what can be told apart so far; `finish()` returns what was held back. A
non-streamed response feeds the whole text once, so streamed and non-streamed answers agree.

- A `ReasoningParser` splits text into (reasoning, content).
- A `ToolCallParser` splits content into plain content and `ToolCallDelta`s (a call's id and
  name first, then pieces of its arguments' JSON text, as OpenAI streams them).

Parsers register by name (`--reasoning-parser`, `--tool-call-parser`); `default_parser_names`
picks them from the model's chat template.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ReasoningParser",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolsParsed",
    "new_tool_call_id",
    "register_reasoning_parser",
    "register_tool_call_parser",
]


def new_tool_call_id() -> str:
    """An OpenAI-style tool call id (`call_` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of a tool call: the first for a call carries `id` and `name`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_stream_dict(self) -> dict[str, Any]:
        function: dict[str, Any] = {}
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        out["function"] = function
        return out


@dataclass(slots=True)
class ToolsParsed:
    """What a `ToolCallParser` told apart from one piece of content."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ReasoningParser(Protocol):
    @property
    def done(self) -> bool:
        """Only content can follow (the rest of the output passes through as it is)."""
        ...

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of the text fed so far that is settled."""
        ...

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held back, at the end of the output."""
        ...


class ToolCallParser(Protocol):
    def feed(self, text: str) -> ToolsParsed: ...

    def finish(self) -> ToolsParsed: ...


ReasoningFactory = Callable[[Mapping[str, Any]], ReasoningParser]
"""Builds a parser for one choice from the request's chat_template_kwargs."""
ToolCallFactory = Callable[[], ToolCallParser]

REASONING_PARSERS: dict[str, ReasoningFactory] = {}
TOOL_CALL_PARSERS: dict[str, ToolCallFactory] = {}


def register_reasoning_parser(*names: str) -> Callable[[ReasoningFactory], ReasoningFactory]:
    def register(factory: ReasoningFactory) -> ReasoningFactory:
        for name in names:
            REASONING_PARSERS[name] = factory
        return factory
    return register


def register_tool_call_parser(*names: str) -> Callable[[ToolCallFactory], ToolCallFactory]:
    def register(factory: ToolCallFactory) -> ToolCallFactory:
        for name in names:
            TOOL_CALL_PARSERS[name] = factory
        return factory
    return register


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (to hold
    back: the marker may be completing across pieces)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
