"""The `llama3_json` tool-call parser (Llama 3.1+ JSON calls; alias `llama`).

An output that opens with `{` (or `<|python_tag|>`) is a list of calls, each
`{"name": ..., "parameters": {...}}` (`arguments` accepted too), separated by `;` or
whitespace; each call goes out whole once its object is complete. Any other output is content,
and so is one whose first object is not a call (later text that is not one is dropped).
"""

from __future__ import annotations

import json

from kvswitch.frontend.parsing.base import (
    ToolCallDelta,
    ToolsParsed,
    new_tool_call_id,
    register_tool_call_parser,
)
from kvswitch.frontend.parsing.hermes_tools import JsonValueScanner

__all__ = ["Llama3JsonToolCallParser"]

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolCallParser:
    def __init__(self) -> None:
        self._buffer = ""
        self._position = 0
        self._state = "undecided"  # undecided, content, between, object, lost
        self._scanner: JsonValueScanner | None = None
        self._object_from = 0
        self._calls = 0

    def feed(self, text: str) -> ToolsParsed:
        out = ToolsParsed()
        if self._state == "content":
            out.content = text
            return out
        self._buffer += text
        if self._state == "undecided":
            head = self._buffer.lstrip()
            if head.startswith(PYTHON_TAG):
                self._position = len(self._buffer) - len(head) + len(PYTHON_TAG)
                self._state = "between"
            elif head.startswith("{"):
                self._position = len(self._buffer) - len(head)
                self._state = "between"
            elif not head or PYTHON_TAG.startswith(head):
                return out  # not told apart yet
            else:
                self._state, out.content, self._buffer = "content", self._buffer, ""
                return out
        self._scan(out)
        return out

    def _scan(self, out: ToolsParsed) -> None:
        buffer = self._buffer
        while self._position < len(buffer) and self._state in ("between", "object"):
            if self._state == "object":
                assert self._scanner is not None
                self._position += self._scanner.scan(buffer[self._position:])
                if self._scanner.done:
                    self._object(buffer[self._object_from:self._position], out)
                continue
            char = buffer[self._position]
            self._position += 1
            if char.isspace() or char == ";":
                continue
            if char == "{":
                self._state, self._object_from = "object", self._position - 1
                self._scanner = JsonValueScanner()
                self._scanner.scan("{")
            else:
                self._state = "lost"

    def _object(self, text: str, out: ToolsParsed) -> None:
        self._state = "between"
        try:
            call = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            self._state = "lost"
            return
        arguments = call.get("parameters", call.get("arguments", {}))
        out.calls.append(ToolCallDelta(self._calls, new_tool_call_id(), call["name"],
                                       json.dumps(arguments, ensure_ascii=False)))
        self._calls += 1

    def finish(self) -> ToolsParsed:
        if self._state == "content" or self._calls:
            return ToolsParsed()
        held, self._buffer = self._buffer, ""
        return ToolsParsed(content=held)

    @property
    def calls(self) -> int:
        return self._calls


@register_tool_call_parser("llama3_json", "llama")
def llama3_json() -> Llama3JsonToolCallParser:
    return Llama3JsonToolCallParser()
