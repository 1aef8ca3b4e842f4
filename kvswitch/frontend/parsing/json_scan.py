"""JSON helpers the tool-call parsers share: where a streamed JSON value ends, and what a
complete call object holds.

A call object is `{"name": <string>, "parameters" | "arguments": <value>}`; anything else
(not JSON, not an object, no string name) is not a call.
"""

from __future__ import annotations

import json
from typing import Any

from kvswitch.frontend.parsing.base import ToolCallDelta, new_tool_call_id

__all__ = ["JsonValueScanner", "load_call", "whole_call"]


class JsonValueScanner:
    """Finds where a JSON object or array ends, fed piece by piece (strings and escapes
    respected)."""

    __slots__ = ("_escape", "_in_string", "depth", "done")

    def __init__(self) -> None:
        self.depth = 0
        self.done = False
        self._in_string = False
        self._escape = False

    @classmethod
    def opened(cls) -> JsonValueScanner:
        """A scanner that has read an object's opening `{`."""
        scanner = cls()
        scanner.scan("{")
        return scanner

    def scan(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them until it ends)."""
        for i, char in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


def load_call(text: str) -> dict[str, Any] | None:
    """The call object `text` holds, or None when it is not one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return value


def whole_call(text: str, index: int) -> ToolCallDelta | None:
    """Call `index` sent whole (new id, name, arguments re-serialised; `parameters` before
    `arguments`), or None when `text` is not a call object."""
    call = load_call(text)
    if call is None:
        return None
    arguments = call.get("parameters", call.get("arguments", {}))
    return ToolCallDelta(index, new_tool_call_id(), call["name"],
                         json.dumps(arguments, ensure_ascii=False))
