"""The `deepseek_r1` reasoning parser (alias `qwen3_thinking`): the output starts in reasoning.

For models whose chat template opens `<think>` in the prompt (DeepSeek-R1, Qwen3 thinking-only
releases): everything up to `</think>` is reasoning, a leading `<think>` is dropped, and an
output without `</think>` is all reasoning, as vLLM's and SMG's parsers of the same names do.
`chat_template_kwargs.enable_thinking` false makes it all content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvswitch.frontend.parsing.base import register_reasoning_parser
from kvswitch.frontend.parsing.qwen3_reasoning import Qwen3ReasoningParser

__all__ = ["DeepSeekR1ReasoningParser"]


class DeepSeekR1ReasoningParser(Qwen3ReasoningParser):
    unopened = "reasoning"


@register_reasoning_parser("deepseek_r1", "qwen3_thinking")
def deepseek_r1(chat_template_kwargs: Mapping[str, Any]) -> DeepSeekR1ReasoningParser:
    return DeepSeekR1ReasoningParser(thinking=chat_template_kwargs.get("enable_thinking", True)
                                     is not False)
