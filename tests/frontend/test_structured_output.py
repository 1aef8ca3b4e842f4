"""Structured output end to end: the OpenAI SDK -> frontend -> a real echo engine, which emits
text satisfying the constraint instead of its echo."""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest

from tests.support.frontend_stack import Stack

MODEL = "Qwen/Qwen3-0.6B"
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a person."}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2},
    "address": {"$ref": "#/$defs/address"}},
    "required": ["name", "age"],
    "$defs": {"address": {"type": "object", "properties": {
        "zip": {"type": "string", "pattern": "[0-9]{5}"}}}}}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}}}},
]


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="none", max_retries=0)


def _check_person(value: dict[str, Any]) -> None:
    assert set(value) == {"name", "age", "email", "tags", "address"}
    assert len(value["name"]) >= 2 and 18 <= value["age"] <= 99
    assert "@" in value["email"] and len(value["tags"]) >= 2
    assert set(value["tags"]) <= {"a", "b"} and re.fullmatch("[0-9]{5}", value["address"]["zip"])


def test_response_format_json_schema(stack: Stack) -> None:
    client = _client(stack)
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert reply.choices[0].finish_reason == "stop"
    _check_person(json.loads(reply.choices[0].message.content or ""))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(
                           model=MODEL, messages=MESSAGES, stream=True,
                           extra_body={"structured_outputs": {"json": PERSON}})
                       if chunk.choices)
    _check_person(json.loads(streamed))
    json_object = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "json_object"})
    assert json.loads(json_object.choices[0].message.content or "") == {}


@pytest.mark.parametrize(("extra", "check"), [
    ({"guided_regex": r"\d{3}-[A-Z]{2}(ok|no)"},
     lambda text: re.fullmatch(r"\d{3}-[A-Z]{2}(ok|no)", text)),
    ({"structured_outputs": {"regex": r"[a-c]+@x\.org"}},
     lambda text: re.fullmatch(r"[a-c]+@x\.org", text)),
    ({"guided_choice": ["positive", "negative"]}, lambda text: text == "positive"),
    ({"guided_json": json.dumps({"type": "array", "items": {"type": "boolean"}})},
     lambda text: json.loads(text) == [True]),
])
def test_guided_options(stack: Stack, extra: dict[str, Any], check: Any) -> None:
    for kind in ("chat", "completions"):
        if kind == "chat":
            text = _client(stack).chat.completions.create(
                model=MODEL, messages=MESSAGES, extra_body=extra).choices[0].message.content
        else:
            text = _client(stack).completions.create(
                model=MODEL, prompt="x", max_tokens=64, extra_body=extra).choices[0].text
        assert check(text or ""), (kind, text)


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_conflicting_or_bad_constraints_are_400(stack: Stack, extra: dict[str, Any],
                                                param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _client(stack).chat.completions.create(model=MODEL, messages=MESSAGES,
                                               extra_body=extra)
    assert info.value.body["param"] == param


@pytest.mark.parametrize("extra", [
    {"guided_grammar": "root ::= 'a'"},
    {"guided_regex": r"(a)\1"},
])
def test_what_the_simulator_cannot_emit_is_400(stack: Stack, extra: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError, match="not support"):
        _client(stack).chat.completions.create(model=MODEL, messages=MESSAGES,
                                               extra_body=extra)


def test_named_tool_choice(stack: Stack) -> None:
    client = _client(stack)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                           tool_choice=choice)  # type: ignore[arg-type]
    assert reply.choices[0].finish_reason == "stop"  # as OpenAI answers a named function
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "text", "unit": "c"}
    arguments = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                                tool_choice=choice,  # type: ignore[arg-type]
                                                stream=True):
        for piece in chunk.choices[0].delta.tool_calls or ():
            assert piece.index == 0
            arguments += piece.function.arguments or ""
    assert json.loads(arguments) == {"city": "text", "unit": "c"}


def test_required_tool_choice(stack: Stack) -> None:
    reply = _client(stack).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                   tools=TOOLS, tool_choice="required")
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "text", "unit": "c"}
    assert reply.choices[0].message.content is None


def test_required_tool_choice_streamed(stack: Stack) -> None:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in _client(stack).chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", stream=True):
        for piece in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(piece.index, ["", ""])
            entry[0] += piece.function.name or ""
            entry[1] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(name, json.loads(args)) for name, args in calls.values()] == [
        ("get_weather", {"city": "text", "unit": "c"})]
