"""How one chat request's output is parsed: which reasoning and tool-call parser each choice gets.

The parser names come from `--reasoning-parser` / `--tool-call-parser`, else from the model's
chat template (`parsing.default_parser_names`); `none` turns one off. `tool_choice` decides the
tool-call parser: `auto` the configured format, `required` and a named function the forced
parsers (the output is constrained to `forced_tool_schema`), `none` or no tools no parser.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvswitch.errors import InvalidRequest
from kvswitch.frontend.openai_models import ChatCompletionRequest
from kvswitch.frontend.parsing import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ChoiceOutput,
    NamedToolCallParser,
    RequiredToolCallParser,
    default_parser_names,
    forced_tool_schema,
)
from kvswitch.frontend.parsing.base import ToolCallParser

__all__ = ["AUTO", "OFF", "ChatOutputPlan", "ParserSettings", "plan_chat_output"]

AUTO, OFF = "auto", "none"


@dataclass(frozen=True)
class ParserSettings:
    """The frontend's `--tool-call-parser` / `--reasoning-parser` (`auto`: from the template)."""

    tool_call: str = AUTO
    reasoning: str = AUTO

    def __post_init__(self) -> None:
        if self.tool_call not in (AUTO, OFF, *TOOL_CALL_PARSERS):
            raise ValueError(f"unknown tool-call parser {self.tool_call!r}; one of "
                             f"{', '.join(sorted(TOOL_CALL_PARSERS))}")
        if self.reasoning not in (AUTO, OFF, *REASONING_PARSERS):
            raise ValueError(f"unknown reasoning parser {self.reasoning!r}; one of "
                             f"{', '.join(sorted(REASONING_PARSERS))}")

    def names(self, chat_template: str | None) -> tuple[str | None, str | None]:
        default_tools, default_reasoning = default_parser_names(chat_template)
        tools = default_tools if self.tool_call == AUTO else self.tool_call
        reasoning = default_reasoning if self.reasoning == AUTO else self.reasoning
        return (None if tools == OFF else tools, None if reasoning == OFF else reasoning)


@dataclass(frozen=True)
class ChatOutputPlan:
    new_choice: Callable[[], ChoiceOutput] | None
    """A parser for one choice's output; None when the text goes out as it is."""
    reasoning: bool
    """The response carries `reasoning_content`."""
    forced_schema: dict[str, Any] | None
    """The JSON schema the output must follow (tool_choice required or named)."""
    tool_calls_finish: bool
    """A choice with tool calls finishes with `tool_calls` (not for a named function, as in
    OpenAI's API)."""


def plan_chat_output(request: ChatCompletionRequest, settings: ParserSettings,
                     chat_template: str | None) -> ChatOutputPlan:
    tool_name, reasoning_name = settings.names(chat_template)
    tools = [t.model_dump(exclude_none=True) for t in request.tools or ()]
    parallel = request.parallel_tool_calls is not False
    named = request.named_tool
    schema: dict[str, Any] | None = None
    make_tools: Callable[[], ToolCallParser] | None = None
    if named is not None:
        schema = forced_tool_schema(tools, named, parallel)
        make_tools = lambda: NamedToolCallParser(named)
    elif request.tool_choice == "required":
        schema = forced_tool_schema(tools, None, parallel)
        make_tools = RequiredToolCallParser
    elif request.parses_tools:
        if tool_name is None:
            raise InvalidRequest('"auto" tool choice needs a tool-call parser: this model\'s '
                                 "chat template names no tool-call format; start the frontend "
                                 "with --tool-call-parser", param="tool_choice")
        make_tools = TOOL_CALL_PARSERS[tool_name]
    make_reasoning = REASONING_PARSERS[reasoning_name] if reasoning_name else None
    if make_tools is None and make_reasoning is None:
        return ChatOutputPlan(None, False, None, False)
    kwargs = request.chat_template_kwargs or {}

    def new_choice() -> ChoiceOutput:
        return ChoiceOutput(make_reasoning(kwargs) if make_reasoning else None,
                            make_tools() if make_tools else None,
                            parallel_tool_calls=parallel,
                            include_reasoning=request.include_reasoning)

    return ChatOutputPlan(new_choice, make_reasoning is not None, schema, named is None)
