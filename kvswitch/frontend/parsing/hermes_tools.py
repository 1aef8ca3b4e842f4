"""The `hermes` tool-call parser (Qwen2.5/Qwen3, Hermes): `<tool_call>{json}</tool_call>`.

Each block holds `{"name": ..., "arguments": {...}}` (`parameters` accepted too). A call is
streamed as soon as its name is known: a first delta with id and name, then the arguments'
JSON text as it arrives, exactly as the model wrote it (a depth scanner tells where the value
ends). A block that is not such an object stays content, markers included; a block the output
ends inside counts when its text already parses. Text around the blocks is content, except
whitespace-only text, which is dropped once the output has a tool call.
"""

from __future__ import annotations

import json
import re

from kvswitch.frontend.parsing.base import (
    ToolCallDelta,
    ToolsParsed,
    held_prefix,
    new_tool_call_id,
    register_tool_call_parser,
)
from kvswitch.frontend.parsing.json_scan import JsonValueScanner, load_call

__all__ = ["HermesToolCallParser"]

START, END = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                   r"\s*:\s*")


def _raw_arguments(body: str, arguments: object) -> str:
    """The arguments' text as written, or re-serialised when the block's layout is unusual."""
    head = _HEAD.match(body)
    if head is not None and body[head.end():head.end() + 1] in ("{", "["):
        scanner = JsonValueScanner()
        rest = body[head.end():]
        end = scanner.scan(rest)
        if scanner.done:
            return rest[:end]
    return json.dumps(arguments, ensure_ascii=False)


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments text) of a block, or None when it is not a tool call."""
    value = load_call(body)
    if value is None:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return value["name"], _raw_arguments(body, arguments)


class HermesToolCallParser:
    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._calls = 0
        self._started = False  # the current call's name went out
        self._scanner: JsonValueScanner | None = None
        self._args_from = 0  # where the arguments' unsent text starts in the buffer
        self._content_seen = False
        self._space = ""

    def _content(self, text: str, out: ToolsParsed) -> None:
        if not text:
            return
        if not text.strip():
            self._space += text
            return
        out.content += self._space + text
        self._space = ""
        self._content_seen = True

    def _flush_space(self, out: ToolsParsed) -> None:
        if self._content_seen and not self._calls:
            out.content += self._space
        self._space = ""

    def feed(self, text: str) -> ToolsParsed:
        out = ToolsParsed()
        self._buffer += text
        while True:
            if not self._in_call:
                position = self._buffer.find(START)
                if position < 0:
                    keep = held_prefix(self._buffer, START)
                    self._content(self._buffer[:len(self._buffer) - keep], out)
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                self._content(self._buffer[:position], out)
                self._flush_space(out)
                self._buffer = self._buffer[position + len(START):]
                self._in_call, self._started, self._scanner = True, False, None
                continue
            position = self._buffer.find(END)
            if position < 0:
                keep = held_prefix(self._buffer, END)
                self._stream_call(self._buffer[:len(self._buffer) - keep], out)
                return out
            self._end_call(self._buffer[:position], out)
            self._buffer = self._buffer[position + len(END):]
            self._in_call = False

    def _stream_call(self, body: str, out: ToolsParsed) -> None:
        if not self._started:
            head = _HEAD.match(body)
            if head is None or len(body) == head.end():
                return
            if body[head.end()] not in "{[":
                return  # a scalar: sent whole when the block ends
            name = json.loads(f'"{head.group(1)}"')
            out.calls.append(ToolCallDelta(self._calls, new_tool_call_id(), name))
            self._started, self._scanner, self._args_from = True, JsonValueScanner(), head.end()
        scanner = self._scanner
        if scanner is None or scanner.done:
            return
        pending = body[self._args_from:]
        taken = scanner.scan(pending)
        if taken:
            out.calls.append(ToolCallDelta(self._calls, arguments=pending[:taken]))
            self._args_from += taken

    def _end_call(self, body: str, out: ToolsParsed) -> None:
        if self._started:
            self._stream_call(body, out)  # the rest of the arguments, if the value ended
            self._calls += 1
            return
        parsed = _parse_call(body)
        if parsed is None:
            self._content(START + body + END, out)
            return
        name, arguments = parsed
        out.calls.append(ToolCallDelta(self._calls, new_tool_call_id(), name, arguments))
        self._calls += 1

    def finish(self) -> ToolsParsed:
        out = ToolsParsed()
        if self._in_call:
            if self._started:
                self._calls += 1
            elif (parsed := _parse_call(self._buffer)) is not None:
                out.calls.append(ToolCallDelta(self._calls, new_tool_call_id(), *parsed))
                self._calls += 1
            else:
                self._content(START + self._buffer, out)
        else:
            self._content(self._buffer, out)
        self._buffer, self._in_call = "", False
        self._flush_space(out)
        return out

    @property
    def calls(self) -> int:
        """Tool calls found so far."""
        return self._calls


@register_tool_call_parser("hermes", "qwen", "qwen3", "qwen25")
def hermes() -> HermesToolCallParser:
    return HermesToolCallParser()
