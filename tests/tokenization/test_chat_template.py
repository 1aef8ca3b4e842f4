"""The bundled Qwen3 chat template renders as transformers' apply_chat_template does."""

from __future__ import annotations

import json

import pytest

from kvswitch.errors import InvalidRequest
from kvswitch.tokenization import load_tokenizer
from kvswitch.tokenization.chat_template import ChatTemplate, TemplateError

QWEN3 = ChatTemplate.from_bundle(load_tokenizer(None))
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Météo actuelle",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_system_and_user_with_generation_prompt() -> None:
    text = QWEN3.render([{"role": "system", "content": "You are helpful."},
                         {"role": "user", "content": "Hi 你好"}])
    assert text == ("<|im_start|>system\nYou are helpful.<|im_end|>\n"
                    "<|im_start|>user\nHi 你好<|im_end|>\n<|im_start|>assistant\n")


def test_without_generation_prompt_and_with_thinking_disabled() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert QWEN3.render(messages, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
    assert QWEN3.render(messages, extra={"enable_thinking": False}) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_earlier_assistant_turns_lose_their_reasoning() -> None:
    text = QWEN3.render([
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nsimple\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
    ])
    assert text == ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n4<|im_end|>\n"
                    "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n")


def test_final_assistant_turn_keeps_reasoning() -> None:
    text = QWEN3.render([
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA"},
    ], add_generation_prompt=False)
    assert text == ("<|im_start|>user\nQ<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\nhmm\n</think>\n\nA<|im_end|>\n")


def test_tools_tool_calls_and_tool_responses() -> None:
    text = QWEN3.render([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "22°C"},
        {"role": "tool", "content": "sunny"},
    ], tools=[WEATHER_TOOL])
    assert text == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user"
        " query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n22°C\n</tool_response>\n"
        "<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert "Météo" in text  # tojson keeps non-ASCII, as transformers' override does


def test_system_prompt_goes_in_front_of_tools() -> None:
    text = QWEN3.render([{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "x"}], tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")


def test_special_tokens_and_raise_exception_reach_custom_templates() -> None:
    template = ChatTemplate.from_bundle(
        load_tokenizer(None),
        override="{{ eos_token }}{% if messages|length > 1 %}{{ raise_exception('one only') }}"
                 "{% endif %}\n  {% for m in messages %}\n{{ m.content }}\n{% endfor %}")
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indent before one.
    assert template.render([{"role": "user", "content": "a"}]) == "<|im_end|>a\n"
    with pytest.raises(TemplateError, match="one only"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_sandbox_blocks_attribute_escapes_and_bad_syntax_is_invalid() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(TemplateError):
        template.render([{"role": "user", "content": "a"}])
    with pytest.raises(InvalidRequest):
        ChatTemplate("{% for %}", {})


def test_continue_final_message_stops_after_its_content() -> None:
    text = QWEN3.render([{"role": "user", "content": "Q"},
                         {"role": "assistant", "content": "The answer is"}],
                        add_generation_prompt=False, continue_final_message=True)
    # Qwen3 gives the final assistant turn an empty thought, as transformers renders it.
    assert text == ("<|im_start|>user\nQ<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is")


def test_a_tool_round_trip_from_the_openai_request_renders() -> None:
    from kvswitch.frontend.openai_models import ChatCompletionRequest, parse_request
    request = parse_request(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "Weather in Köln?"},
        {"role": "assistant", "content": None, "reasoning_content": "look it up",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Köln"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}],
        "tools": [WEATHER_TOOL]})
    text = QWEN3.render([m.for_template() for m in request.messages],
                        tools=[t.model_dump(exclude_none=True) for t in request.tools or ()])
    # The arguments string reaches the template as an object (as vLLM passes it), so the
    # template's `tojson` writes it once, not as a quoted string.
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>'
            in text)
    assert text.endswith("<|im_start|>user\n<tool_response>\n{\"celsius\": 21}\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert '"name": "get_weather"' in text.split("<tools>\n")[1]
