"""/v1/messages through the real `anthropic` SDK against a real echo engine, streamed and not.

The frontend's chat template renders only the last message (`ECHO_TEMPLATE`), so the last user
message is what the model "says": thinking, text and tool calls come back as Anthropic blocks.
Messages always carry max_tokens, with which the echo engine repeats its prompt instead of
ending: each "model output" ends with `END`, a stop sequence, in its place.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from kvswitch.tokenization import load_tokenizer
from tests.support.frontend_stack import Stack

MODEL = "Qwen/Qwen3-0.6B"
TOOLS: list[Any] = [{"name": "get_weather", "description": "Weather now", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>'
SAYS = f"<think>Weather needed.</think>Let me look.\n{CALL}<end>"
END = ["<end>"]
THINK: Any = {"type": "enabled", "budget_tokens": 1024}


def _client(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url, api_key="none", max_retries=0)


def _says(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_message_with_thinking_text_and_tool_use(echo_stack: Stack) -> None:
    client = _client(echo_stack)
    message = client.messages.create(model=MODEL, max_tokens=1100, messages=_says(SAYS),
                                     tools=TOOLS, stop_sequences=END, thinking=THINK)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg-") and message.stop_reason == "tool_use"
    kinds = [block.type for block in message.content]
    assert kinds == ["thinking", "text", "tool_use"]
    thinking, text, tool = message.content
    assert thinking.thinking == "Weather needed."  # type: ignore[union-attr]
    assert text.text == "Let me look.\n"  # type: ignore[union-attr]
    assert tool.name == "get_weather" and tool.input == {"city": "Köln"}  # type: ignore[union-attr]
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    # Without `thinking` the model is not asked to think (the template closes an empty block),
    # so a thought in its output is plain text, as in Anthropic's API and SMG.
    plain = client.messages.create(model=MODEL, max_tokens=200, messages=_says(SAYS),
                                   tools=TOOLS, stop_sequences=END)
    assert [block.type for block in plain.content] == ["text", "tool_use"]
    assert plain.content[0].text.startswith("<think>Weather")  # type: ignore[union-attr]


def test_streamed_message_accumulates_to_the_same_blocks(echo_stack: Stack) -> None:
    client = _client(echo_stack)
    with client.messages.stream(model=MODEL, max_tokens=1100, messages=_says(SAYS),
                                tools=TOOLS, stop_sequences=END, thinking=THINK) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Köln"}  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens > 0


def test_tool_results_and_stop_reasons(echo_stack: Stack) -> None:
    client = _client(echo_stack)
    history: list[Any] = [
        {"role": "user", "content": "Weather in Köln?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1",
                                           "name": "get_weather", "input": {"city": "Köln"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": "21 degrees"},
                                     {"type": "text", "text": "It is 21 degrees.<end>"}]}]
    reply = client.messages.create(model=MODEL, max_tokens=100, messages=history, tools=TOOLS,
                                   system=[{"type": "text", "text": "Be brief."}],
                                   stop_sequences=END)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "<end>"
    assert reply.content[0].text == "It is 21 degrees."  # type: ignore[union-attr]
    short = client.messages.create(model=MODEL, max_tokens=2, messages=_says("one two three"))
    assert short.stop_reason == "max_tokens"
    assert short.content[0].text == "one two"  # type: ignore[union-attr]


def test_stop_reasons_map_from_openai_finishes() -> None:
    from kvswitch.frontend.serving_messages import _stop
    assert _stop("stop", None, []) == ("end_turn", None)
    assert _stop("stop", 151645, ["x"]) == ("end_turn", None)
    assert _stop("stop", "x", ["x"]) == ("stop_sequence", "x")
    assert _stop("length", None, []) == ("max_tokens", None)
    assert _stop("tool_calls", "x", ["x"]) == ("tool_use", None)


def test_errors_use_anthropics_body(echo_stack: Stack) -> None:
    client = _client(echo_stack)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}])
    assert info.value.body["type"] == "error"  # type: ignore[index]
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(model=MODEL, max_tokens=2000, messages=_says("x"),
                               thinking={"type": "enabled", "budget_tokens": 100})
    with pytest.raises(anthropic.BadRequestError, match="greater than"):
        client.messages.create(model=MODEL, max_tokens=1024, messages=_says("x"), thinking=THINK)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=10, messages=_says("x"))
    missing = httpx.post(echo_stack.base_url + "/v1/messages",
                         json={"model": MODEL, "messages": _says("x")})
    assert missing.status_code == 400 and "max_tokens" in json.dumps(missing.json())


def test_messages_translate_to_a_chat_request_the_real_template_renders() -> None:
    from kvswitch.frontend.anthropic_protocol import MessagesRequest, to_chat_request
    from kvswitch.frontend.openai_models import parse_request
    from kvswitch.tokenization import load_tokenizer
    from kvswitch.tokenization.chat_template import ChatTemplate
    request = parse_request(MessagesRequest, {
        "model": MODEL, "max_tokens": 10, "system": "Be brief.", "tools": TOOLS,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"}, "metadata": {"user_id": "u1"},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "look", "signature": "s"},
                {"type": "tool_use", "id": "t1", "name": "get_weather",
                 "input": {"city": "Köln"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "21C"}]}]}]})
    chat = to_chat_request(request)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[2].reasoning_content == "look"
    assert chat.messages[3].tool_call_id == "t1" and chat.messages[3].content == "21C"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.chat_template_kwargs == {"enable_thinking": False} and chat.user == "u1"
    assert chat.tools and chat.tools[0].function.parameters == TOOLS[0]["input_schema"]
    text = ChatTemplate.from_bundle(load_tokenizer(None)).render(
        [m.for_template() for m in chat.messages],
        tools=[t.model_dump(exclude_none=True) for t in chat.tools])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}' in text
    assert "<tool_response>\n21C\n</tool_response>" in text


def test_count_tokens(echo_stack: Stack) -> None:
    client = _client(echo_stack)
    text = "Grüße 你好 and some words"
    count = client.messages.count_tokens(model=MODEL, messages=_says(text))
    # The echo template renders the last message alone: its tokens are the prompt.
    assert count.input_tokens == len(load_tokenizer(None).encode(text))
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=_says(text))
