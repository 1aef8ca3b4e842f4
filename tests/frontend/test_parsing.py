"""The reasoning and tool-call parsers, fed whole and piece by piece (the two must agree)."""

from __future__ import annotations

import json

import pytest

from kvswitch.frontend.chat_output import ParserSettings, plan_chat_output
from kvswitch.frontend.openai_models import ChatCompletionRequest, parse_request
from kvswitch.frontend.parsing import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ChoiceOutput,
    ParsedDelta,
    RequiredToolCallParser,
    default_parser_names,
)
from kvswitch.tokenization import load_tokenizer


def _parse(text: str, piece: int, **kwargs: object) -> tuple[str, str, list[tuple[str, str]]]:
    output = ChoiceOutput(REASONING_PARSERS["qwen3"](kwargs.pop("template_kwargs", {})),
                          TOOL_CALL_PARSERS["hermes"](), **kwargs)  # type: ignore[arg-type]
    parsed = ParsedDelta()
    for start in range(0, len(text), piece):
        parsed.extend(output.feed(text[start:start + piece]))
    parsed.extend(output.finish())
    calls: dict[int, list[str]] = {}
    for delta in parsed.calls:
        if delta.id is not None:
            assert delta.id.startswith("call_") and delta.name is not None
            calls[delta.index] = [delta.name, ""]
        calls[delta.index][1] += delta.arguments
    assert output.tool_calls == len(calls)
    return parsed.reasoning, parsed.content, [(n, a) for n, a in calls.values()]


WEATHER = '{"name": "get_weather", "arguments": {"city": "Pa}ris\\"{", "days": [1, 2]}}'
CASES = [
    ("<think>I reason</think>The answer is 4.", ("I reason", "The answer is 4.", [])),
    ("\n<think>\nx\n</think>\n\nok", ("\n\nx\n", "\n\nok", [])),
    ("I reason</think>answer", ("", "I reason</think>answer", [])),
    ("<think>unfinished", ("unfinished", "", [])),
    ("plain <tool text", ("", "plain <tool text", [])),
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>",
     ("", "Let me check.\n", [("get_weather", '{"city": "Pa}ris\\"{", "days": [1, 2]}')])),
    ((f"<think>t</think>\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
      '{"name": "now", "arguments": {}}\n</tool_call>'),
     ("t", "", [("get_weather", '{"city": "Pa}ris\\"{", "days": [1, 2]}'), ("now", "{}")])),
    ('<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', ("", "", [("f",
                                                                                   '{"a": 1}')])),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', ("", "", [("f", '{"a": 1}')])),
    ("<tool_call>not json</tool_call> after", ("", "<tool_call>not json</tool_call> after", [])),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_streamed_and_whole_outputs_agree(text: str, expected: tuple[object, ...]) -> None:
    for piece in (1, 2, 5, len(text)):
        assert _parse(text, piece) == expected, piece


def test_arguments_stream_before_the_block_ends() -> None:
    output = ChoiceOutput(None, TOOL_CALL_PARSERS["hermes"]())
    first = output.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Pa')
    assert [(c.name, c.arguments) for c in first.calls] == [("f", ""), (None, '{"city": "Pa')]
    assert first.as_stream_dict()["tool_calls"] == [
        {"index": 0, "id": first.calls[0].id, "type": "function",
         "function": {"name": "f", "arguments": '{"city": "Pa'}}]
    rest = output.feed('ris"}}\n</tool')
    assert [c.arguments for c in rest.calls] == ['ris"}'] and rest.content == ""


def test_enable_thinking_false_and_parallel_false() -> None:
    text = "<think>x</think>y"
    assert _parse(text, 3, template_kwargs={"enable_thinking": False}) == ("", text, [])
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>' \
          '{"name": "b", "arguments": {}}</tool_call>'
    output = ChoiceOutput(None, TOOL_CALL_PARSERS["hermes"](), parallel_tool_calls=False)
    parsed = output.feed(two)
    parsed.extend(output.finish())
    assert [c.name for c in parsed.calls] == ["a"] and output.tool_calls == 1


def test_required_output_is_a_list_of_calls_each_sent_when_complete() -> None:
    parser = RequiredToolCallParser()
    first = parser.feed('[{"name": "a", "parameters": {"x": "}"}}, {"name": "b", "param')
    assert [(c.index, c.name, json.loads(c.arguments)) for c in first.calls] == [
        (0, "a", {"x": "}"})]
    second = parser.feed('eters": {}}]')
    assert [(c.index, c.name, c.arguments) for c in second.calls] == [(1, "b", "{}")]
    assert parser.finish().calls == [] and parser.calls == 2
    for text in ("not json", '[{"nam": 1}]', "{}"):
        other = RequiredToolCallParser()
        assert other.feed(text).calls == [] and other.finish().content == text


def test_defaults_come_from_the_chat_template() -> None:
    assert default_parser_names(load_tokenizer(None).chat_template) == ("hermes", "qwen3")
    assert default_parser_names("{{ messages }}") == (None, None)
    assert default_parser_names("{{- '<|python_tag|>' }}") == ("llama3_json", None)
    assert ParserSettings("none", "auto").names(load_tokenizer(None).chat_template) == \
        (None, "qwen3")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ParserSettings("nope")


def _chat(**fields: object) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {
        "messages": [{"role": "user", "content": "x"}], **fields})


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
         {"type": "function", "function": {"name": "g"}}]


def test_tool_choice_plans() -> None:
    template = load_tokenizer(None).chat_template
    settings = ParserSettings()
    plain = plan_chat_output(_chat(), ParserSettings("none", "none"), template)
    assert plain.new_choice is None and plain.forced_schema is None
    named = plan_chat_output(_chat(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "f"}}), settings, template)
    assert named.forced_schema == TOOLS[0]["function"]["parameters"]  # type: ignore[index]
    assert not named.tool_calls_finish
    required = plan_chat_output(_chat(tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False), settings, template)
    assert required.forced_schema is not None and required.forced_schema["maxItems"] == 1
    assert required.tool_calls_finish
    with pytest.raises(Exception, match="tool-call parser"):
        plan_chat_output(_chat(tools=TOOLS), ParserSettings("none"), template)


@pytest.mark.parametrize(("text", "expected"), [
    ("I reason</think>answer", ("I reason", "answer")),
    ("<think>I reason</think>answer", ("I reason", "answer")),
    ("all thought", ("all thought", "")),
    ("<thi", ("<thi", "")),
])
def test_deepseek_r1_starts_in_reasoning(text: str, expected: tuple[str, str]) -> None:
    for piece in (1, 3, len(text)):
        parser = REASONING_PARSERS["deepseek_r1"]({})
        reasoning, content = "", ""
        for start in range(0, len(text), piece):
            r, c = parser.feed(text[start:start + piece])
            reasoning, content = reasoning + r, content + c
        r, c = parser.finish()
        assert (reasoning + r, content + c) == expected, piece
    off = REASONING_PARSERS["qwen3_thinking"]({"enable_thinking": False})
    assert off.feed(text) == ("", text)


def test_passthrough_once_only_content_can_follow() -> None:
    output = ChoiceOutput(REASONING_PARSERS["qwen3"]({}), None)
    assert not output.passthrough
    output.feed("<think>a")
    assert not output.passthrough
    output.feed("</think>b")
    assert output.passthrough
    with_tools = ChoiceOutput(REASONING_PARSERS["qwen3"]({}), TOOL_CALL_PARSERS["hermes"]())
    with_tools.feed("plain")
    assert not with_tools.passthrough


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('{"name": "a", "parameters": {"x": "};"}}; {"name": "b", "arguments": {}}', "",
     [("a", {"x": "};"}), ("b", {})]),
    ('<|python_tag|>{"name": "a", "parameters": {}}', "", [("a", {})]),
    ("plain {text}", "plain {text}", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ("", "", []),
])
def test_llama3_json_calls(text: str, content: str, calls: list[tuple[str, object]]) -> None:
    for piece in (1, 4, max(1, len(text))):
        parser = TOOL_CALL_PARSERS["llama3_json"]()
        got_content, got = "", []
        for start in range(0, len(text), piece):
            parsed = parser.feed(text[start:start + piece])
            got_content += parsed.content
            got += parsed.calls
        rest = parser.finish()
        got_content += rest.content
        got += rest.calls
        assert got_content == content, piece
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls
        assert [c.index for c in got] == list(range(len(calls)))
