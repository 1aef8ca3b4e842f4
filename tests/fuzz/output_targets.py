"""Fuzz target for the frontend's parsers of model output: every tool-call parser (and the
forced-tool ones) and every reasoning parser, fed one output in two pieces. A model's output
is outside input too (an echoing or prompted model writes what the client chose). The check:
feeding and finishing never raise.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvswitch.frontend.parsing import REASONING_PARSERS, TOOL_CALL_PARSERS
from kvswitch.frontend.parsing.forced_tools import NamedToolCallParser, RequiredToolCallParser
from tests.fuzz.base import Target
from tests.fuzz.raw import Codec

__all__ = ["MODEL_OUTPUT"]

_PIECES = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>", "{", "}",
           "[", "]", '"name": "f"', '"arguments": ', '"parameters": ', ", ", ":", '"', "\n",
           "x", "1", "null", "[" * 1200, "]" * 1200, '{"a": ' * 1200]  # past the recursion limit


def check_model_output(args: tuple[str, int]) -> None:
    text, split = args
    parsers = [factory() for factory in TOOL_CALL_PARSERS.values()]
    parsers += [NamedToolCallParser("f"), RequiredToolCallParser()]
    for parser in parsers:
        parser.feed(text[:split])
        parser.feed(text[split:])
        parser.finish()
    for reasoning_factory in REASONING_PARSERS.values():
        reasoning = reasoning_factory({})
        reasoning.feed(text[:split])
        reasoning.feed(text[split:])
        reasoning.finish()


MODEL_OUTPUT = Target("model-output", st.tuples(
    st.lists(st.sampled_from(_PIECES) | st.text(max_size=6), max_size=16).map("".join),
    st.integers(0, 255)), check_model_output, Codec("text", (255,)))
