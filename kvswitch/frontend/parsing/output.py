"""One choice's output through its reasoning parser, then its tool-call parser.

`ChoiceOutput.feed(text)` returns a `ParsedDelta` (reasoning, content, tool-call pieces) for a
streamed chunk; `finish()` what was held back. `parallel_tool_calls: false` keeps the first
call only; `include_reasoning: false` drops the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvswitch.frontend.parsing.base import ReasoningParser, ToolCallDelta, ToolCallParser

__all__ = ["ChoiceOutput", "ParsedDelta"]


@dataclass(slots=True)
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)

    def as_stream_dict(self) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.reasoning:  # both names: vLLM's current one and the one SMG and older vLLM use
            delta["reasoning"] = delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.calls:
            delta["tool_calls"] = [call.as_stream_dict() for call in _merged(self.calls)]
        return delta


def _merged(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call as one piece (a name and the first arguments together)."""
    out: list[ToolCallDelta] = []
    for call in calls:
        last = out[-1] if out else None
        if last is not None and last.index == call.index and call.id is None:
            out[-1] = ToolCallDelta(last.index, last.id, last.name,
                                    last.arguments + call.arguments)
        else:
            out.append(call)
    return out


class ChoiceOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None, *,
                 parallel_tool_calls: bool = True, include_reasoning: bool = True) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._parallel = parallel_tool_calls
        self._include_reasoning = include_reasoning
        self.tool_calls = 0
        """Tool calls sent so far."""
        self.passthrough = tools is None and reasoning is None
        """The rest of the output is plain content: a caller may skip `feed` and `finish`."""

    def _split(self, reasoning: str, content: str, final: bool) -> ParsedDelta:
        out = ParsedDelta(reasoning if self._include_reasoning else "")
        tools = self._tools
        if tools is None:
            out.content = content
            return out
        parsed = tools.feed(content) if content else None
        if parsed is not None:
            out.content = parsed.content
            out.calls = parsed.calls
        if final:
            rest = tools.finish()
            out.content += rest.content
            out.calls.extend(rest.calls)
        if not self._parallel:
            out.calls = [c for c in out.calls if c.index == 0]
        self.tool_calls = max([self.tool_calls, *(c.index + 1 for c in out.calls)])
        return out

    def feed(self, text: str) -> ParsedDelta:
        if self._reasoning is None:
            return self._split("", text, False)
        reasoning, content = self._reasoning.feed(text)
        if self._tools is None and self._reasoning.done:
            self.passthrough = True
        return self._split(reasoning, content, False)

    def finish(self) -> ParsedDelta:
        if self._reasoning is None:
            return self._split("", "", True)
        reasoning, content = self._reasoning.finish()
        return self._split(reasoning, content, True)
