"""Tool calls and reasoning through the real OpenAI SDK's typed responses, streamed and not.

The frontend's chat template renders only the last message (`ECHO_TEMPLATE`) and the engine
echoes its prompt, so each user message below is what the model "says".
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.support.frontend_stack import Stack

MODEL = "Qwen/Qwen3-0.6B"
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}}}},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln", "days": [1, 2]}}\n' \
       '</tool_call>'
SAYS = f'<think>The user wants weather.</think>\n\nLet me look.\n{CALL}\n<tool_call>\n' \
       '{"name": "get_time", "arguments": {}}\n</tool_call>'


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="none", max_retries=0)


def _says(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_tool_calls_and_reasoning_in_one_response(echo_stack: Stack) -> None:
    reply = _client(echo_stack).chat.completions.create(model=MODEL, messages=_says(SAYS),
                                                         tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content == "\n\nLet me look.\n"  # as SMG keeps it
    assert message.model_extra["reasoning_content"] == "The user wants weather."
    calls = message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Köln", "days": [1, 2]}
    assert calls[1].function.arguments == "{}"
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert calls[0].id != calls[1].id


def test_streamed_tool_calls_arrive_as_argument_deltas(echo_stack: Stack) -> None:
    stream = _client(echo_stack).chat.completions.create(
        model=MODEL, messages=_says(SAYS), tools=TOOLS, stream=True)
    reasoning, content, finish = "", "", None
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        reasoning += extra.get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or ():
            if call.id is not None:
                assert call.index not in calls and call.function.name
                calls[call.index] = {"id": call.id, "name": call.function.name, "args": ""}
            calls[call.index]["args"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert reasoning == "The user wants weather." and content == "\n\nLet me look.\n"
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["args"]) == {"city": "Köln", "days": [1, 2]}


def test_parallel_tool_calls_false_keeps_the_first(echo_stack: Stack) -> None:
    reply = _client(echo_stack).chat.completions.create(
        model=MODEL, messages=_says(SAYS), tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_weather"]


def test_tool_choice_none_leaves_the_text(echo_stack: Stack) -> None:
    reply = _client(echo_stack).chat.completions.create(
        model=MODEL, messages=_says(CALL), tools=TOOLS, tool_choice="none")
    assert reply.choices[0].message.content == CALL
    assert not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"


def test_reasoning_without_tools_and_thinking_off(echo_stack: Stack) -> None:
    client = _client(echo_stack)
    text = "<think>2 + 2 is 4</think>It is 4."
    reply = client.chat.completions.create(model=MODEL, messages=_says(text))
    assert reply.choices[0].message.content == "It is 4."
    assert reply.choices[0].message.model_extra["reasoning_content"] == "2 + 2 is 4"
    assert reply.choices[0].message.model_extra["reasoning"] == "2 + 2 is 4"  # vLLM's name
    off = client.chat.completions.create(
        model=MODEL, messages=_says(text),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == text
    assert off.choices[0].message.model_extra["reasoning_content"] is None
    hidden = client.chat.completions.create(model=MODEL, messages=_says(text),
                                            extra_body={"include_reasoning": False})
    assert hidden.choices[0].message.model_extra["reasoning_content"] is None
    assert hidden.choices[0].message.content == "It is 4."


def test_bad_tool_choice_is_a_400(echo_stack: Stack) -> None:
    client = _client(echo_stack)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=_says("x"), tools=TOOLS,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"


def test_each_choice_has_its_own_parsers(echo_stack: Stack) -> None:
    client = _client(echo_stack)
    reply = client.chat.completions.create(model=MODEL, messages=_says(SAYS), tools=TOOLS, n=2,
                                           logprobs=True)
    for choice in reply.choices:
        assert [c.function.name for c in choice.message.tool_calls or ()] == [
            "get_weather", "get_time"]
        assert choice.message.model_extra["reasoning_content"] == "The user wants weather."
        assert choice.logprobs is not None and choice.logprobs.content
    names: dict[int, list[str]] = {0: [], 1: []}
    for chunk in client.chat.completions.create(model=MODEL, messages=_says(SAYS), tools=TOOLS,
                                                n=2, stream=True):
        for choice in chunk.choices:
            names[choice.index] += [c.function.name for c in choice.delta.tool_calls or ()
                                    if c.function and c.function.name]
    assert names == {0: ["get_weather", "get_time"], 1: ["get_weather", "get_time"]}
