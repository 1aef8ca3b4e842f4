"""Reasoning and tool-call parsers: a model's raw output into OpenAI's message fields.

One module per format, registered by name in `base` (importing this package registers them).
`default_parser_names` picks the formats a chat template speaks: `<tool_call>` -> `hermes`,
`<|python_tag|>` (Llama 3.1+) -> `llama3_json`, `<think>` -> `qwen3`; `--tool-call-parser` /
`--reasoning-parser` override it (`none` turns parsing off).
"""

from __future__ import annotations

import functools

from kvswitch.frontend.parsing import (  # noqa: F401 - importing registers them
    deepseek_r1_reasoning,
    hermes_tools,
    llama3_json_tools,
    qwen3_reasoning,
)
from kvswitch.frontend.parsing.base import REASONING_PARSERS, TOOL_CALL_PARSERS
from kvswitch.frontend.parsing.forced_tools import (
    NamedToolCallParser,
    RequiredToolCallParser,
    forced_tool_schema,
)
from kvswitch.frontend.parsing.output import ChoiceOutput, ParsedDelta

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ChoiceOutput",
    "NamedToolCallParser",
    "ParsedDelta",
    "RequiredToolCallParser",
    "default_parser_names",
    "forced_tool_schema",
]

NONE = "none"


@functools.lru_cache(maxsize=16)
def default_parser_names(chat_template: str | None) -> tuple[str | None, str | None]:
    """(tool-call parser, reasoning parser) for a chat template; None where it has neither."""
    template = chat_template or ""
    tools = ("hermes" if "<tool_call>" in template else
             "llama3_json" if "<|python_tag|>" in template else None)
    return tools, "qwen3" if "<think>" in template else None
