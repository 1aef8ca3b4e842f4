"""The `llama3_json` tool-call parser (Llama 3.1+ JSON calls; alias `llama`).

An output that opens with `{` (or `<|python_tag|>`) is a list of calls, each
`{"name": ..., "parameters": {...}}` (`arguments` accepted too), separated by `;` or
whitespace; each call goes out whole once its object is complete. Any other output is content,
and so is one whose first object is not a call (later text that is not one is dropped).
"""

from __future__ import annotations

from kvswitch.frontend.parsing.base import (
    ToolsParsed,
    register_tool_call_parser,
)
from kvswitch.frontend.parsing.json_scan import JsonValueScanner, whole_call

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
                self._scanner = JsonValueScanner.opened()
            else:
                self._state = "lost"

    def _object(self, text: str, out: ToolsParsed) -> None:
        call = whole_call(text, self._calls)
        if call is None:
            self._state = "lost"
            return
        self._state = "between"
        out.calls.append(call)
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
