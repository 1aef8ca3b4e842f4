"""Tool calls the request forced (`tool_choice` `required` or a named function), as vLLM does.

The engine is constrained to a JSON schema (`forced_tool_schema`), so the output is JSON:
- named: the function's arguments object; streamed as that call's argument deltas.
- required: `[{"name": ..., "parameters": {...}}, ...]`; parsed once the output ends (each call
  then goes out whole).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvswitch.frontend.parsing.base import ToolCallDelta, ToolsParsed, new_tool_call_id

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
    """The content is a JSON array of calls; not valid JSON, it stays content."""

    def __init__(self) -> None:
        self._buffer = ""
        self._calls = 0

    def feed(self, text: str) -> ToolsParsed:
        self._buffer += text
        return ToolsParsed()

    def finish(self) -> ToolsParsed:
        text, self._buffer = self._buffer, ""
        try:
            value = json.loads(text)
        except ValueError:
            return ToolsParsed(content=text)
        if not isinstance(value, list) or not all(
                isinstance(v, dict) and isinstance(v.get("name"), str) for v in value):
            return ToolsParsed(content=text)
        out = ToolsParsed()
        for index, call in enumerate(value):
            arguments = call.get("parameters", call.get("arguments", {}))
            out.calls.append(ToolCallDelta(index, new_tool_call_id(), call["name"],
                                           json.dumps(arguments, ensure_ascii=False)))
        self._calls = len(value)
        return out

    @property
    def calls(self) -> int:
        return self._calls
