"""Tool calls the request forced (`tool_choice` `required` or a named function), as vLLM does.

The engine is constrained to a JSON schema (`forced_tool_schema`), so the output is JSON:
- named: the function's arguments object; streamed as that call's argument deltas.
- required: `[{"name": ..., "parameters": {...}}, ...]`; each call goes out whole as soon as
  its object is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvswitch.frontend.parsing.base import ToolCallDelta, ToolsParsed, new_tool_call_id
from kvswitch.frontend.parsing.json_scan import JsonValueScanner, whole_call

__all__ = ["NamedToolCallParser", "RequiredToolCallParser", "forced_tool_schema"]


def forced_tool_schema(tools: Sequence[dict[str, Any]], named: str | None,
                       parallel: bool) -> dict[str, Any]:
    """The JSON schema the output must follow: the named function's parameters, or (required)
    a non-empty array of calls to any of the tools (one at most unless parallel)."""
    def parameters(tool: dict[str, Any]) -> dict[str, Any]:
        return tool["function"].get("parameters") or {"type": "object", "properties": {}}

    if named is not None:
        for tool in tools:
            if tool["function"]["name"] == named:
                return parameters(tool)
        raise KeyError(named)
    item = {"anyOf": [{"type": "object",
                       "properties": {"name": {"type": "string",
                                               "enum": [t["function"]["name"]]},
                                      "parameters": parameters(t)},
                       "required": ["name", "parameters"]} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedToolCallParser:
    """All content is the arguments of one call to `name`."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> ToolsParsed:
        out = ToolsParsed()
        if not self._started:
            self._started = True
            out.calls.append(ToolCallDelta(0, new_tool_call_id(), self._name))
        if text:
            out.calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> ToolsParsed:
        return self.feed("") if not self._started else ToolsParsed()

    @property
    def calls(self) -> int:
        return 1 if self._started else 0


class RequiredToolCallParser:
    """The content is a JSON array of calls, each sent as soon as its object is complete; an
    output that is not such an array stays content."""

    def __init__(self) -> None:
        self._buffer = ""
        self._position = 0  # what of the buffer has been looked at
        self._state = "start"  # start, between, item, done, lost
        self._scanner: JsonValueScanner | None = None
        self._item_from = 0
        self._calls = 0

    def feed(self, text: str) -> ToolsParsed:
        self._buffer += text
        out = ToolsParsed()
        buffer = self._buffer
        while self._position < len(buffer) and self._state not in ("done", "lost"):
            char = buffer[self._position]
            if self._state == "item":
                assert self._scanner is not None
                self._position += self._scanner.scan(buffer[self._position:])
                if self._scanner.done:
                    self._item(buffer[self._item_from:self._position], out)
                continue
            self._position += 1
            if char.isspace() or (char == "," and self._state == "between"):
                continue
            if char == "[" and self._state == "start":
                self._state = "between"
            elif char == "]" and self._state == "between":
                self._state = "done"
            elif char == "{" and self._state == "between":
                self._state, self._item_from = "item", self._position - 1
                self._scanner = JsonValueScanner.opened()
            else:
                self._state = "lost"
        return out

    def _item(self, text: str, out: ToolsParsed) -> None:
        call = whole_call(text, self._calls)
        if call is None:
            self._state = "lost"
            return
        self._state = "between"
        out.calls.append(call)
        self._calls += 1

    def finish(self) -> ToolsParsed:
        if self._calls or self._state == "done":
            return ToolsParsed()  # what follows sent calls is not content
        return ToolsParsed(content=self._buffer)

    @property
    def calls(self) -> int:
        return self._calls
