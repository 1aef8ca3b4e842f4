"""The `qwen3` reasoning parser: `<think>…</think>` at the start of the output is reasoning.

As vLLM's and SMG's `qwen3`: the output must open with `<think>` (whitespace before it is kept);
otherwise it is all content, a `</think>` in it included. Once opened, everything up to
`</think>` is reasoning and the rest content; an output that ends inside the block is all
reasoning. With `chat_template_kwargs.enable_thinking` false the template already closed an
empty block in the prompt, so the output is all content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvswitch.frontend.parsing.base import held_prefix, register_reasoning_parser

__all__ = ["Qwen3ReasoningParser"]

START, END = "<think>", "</think>"


class Qwen3ReasoningParser:
    unopened = "content"
    """What output that does not open with `<think>` is."""

    def __init__(self, thinking: bool = True) -> None:
        self._state = "undecided" if thinking else "content"
        self._buffer = ""

    @property
    def done(self) -> bool:
        """Only content can follow."""
        return self._state == "content"

    def feed(self, text: str) -> tuple[str, str]:
        if self._state == "content":
            return "", text
        self._buffer += text
        if self._state == "undecided":
            stripped = self._buffer.lstrip()
            if stripped.startswith(START):
                # The tag goes; whitespace before it stays with the thought (as SMG keeps it).
                lead = self._buffer[:len(self._buffer) - len(stripped)]
                self._state, self._buffer = "reasoning", lead + stripped[len(START):]
            elif START.startswith(stripped):
                return "", ""  # not told apart yet
            elif self.unopened == "content":
                self._state, content, self._buffer = "content", self._buffer, ""
                return "", content
            else:
                self._state = "reasoning"
        position = self._buffer.find(END)
        if position >= 0:
            reasoning, content = self._buffer[:position], self._buffer[position + len(END):]
            self._state, self._buffer = "content", ""
            return reasoning, content
        keep = held_prefix(self._buffer, END)
        reasoning = self._buffer[:len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        held, self._buffer = self._buffer, ""
        if self._state == "reasoning" or (self._state == "undecided" and
                                          self.unopened == "reasoning"):
            return held, ""
        return "", held


@register_reasoning_parser("qwen3")
def qwen3(chat_template_kwargs: Mapping[str, Any]) -> Qwen3ReasoningParser:
    return Qwen3ReasoningParser(thinking=chat_template_kwargs.get("enable_thinking", True)
                                is not False)
