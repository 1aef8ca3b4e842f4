"""OpenAI request fields -> SamplingParams, and strict rejection of what is not implemented."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvswitch.errors import InvalidRequest
from kvswitch.frontend.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    parse_request,
)
from kvswitch.frontend.sampling import build_sampling_params, max_tokens_for

MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": MESSAGES, **fields})


def test_every_sampling_field_maps() -> None:
    request = _chat(max_completion_tokens=32, max_tokens=99, temperature=0.5, top_p=0.9, n=2,
                    stop=["a", "b"], stop_token_ids=[7], seed=-3, presence_penalty=0.5,
                    frequency_penalty=-0.5, logit_bias={"11": 5}, logprobs=True, top_logprobs=3,
                    top_k=40, min_p=0.1, min_tokens=2, ignore_eos=True, repetition_penalty=1.1,
                    skip_special_tokens=False, include_stop_str_in_output=True,
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "x", "schema": {"type": "object"}}})
    params = build_sampling_params(request, max_tokens=request.requested_max_tokens,
                                   vocab_size=100)
    assert params.max_tokens == 32  # max_completion_tokens wins over the deprecated max_tokens
    assert params.temperature == pytest.approx(0.5) and params.top_p == pytest.approx(0.9)
    assert params.n == 2 and list(params.stop) == ["a", "b"] and list(params.stop_token_ids) == [7]
    assert params.seed == -3 and params.logprobs == 3 and dict(params.logit_bias) == {11: 5.0}
    assert params.presence_penalty == pytest.approx(0.5)
    assert params.frequency_penalty == pytest.approx(-0.5)
    assert params.top_k == 40 and params.min_p == pytest.approx(0.1) and params.min_tokens == 2
    assert params.ignore_eos and not params.skip_special_tokens
    assert params.include_stop_str_in_output
    assert params.repetition_penalty == pytest.approx(1.1)
    assert json.loads(params.json_schema) == {"type": "object"}


def test_defaults_and_model_defaults() -> None:
    params = build_sampling_params(_chat(), max_tokens=None, vocab_size=100,
                                   defaults={"temperature": 0.6, "top_k": 20})
    assert not params.HasField("max_tokens") and not params.HasField("seed")
    assert not params.HasField("logprobs")
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert params.temperature == pytest.approx(0.6) and params.top_k == 20
    explicit = build_sampling_params(_chat(temperature=0, top_k=-1), max_tokens=None,
                                     vocab_size=100, defaults={"temperature": 0.6, "top_k": 20})
    assert explicit.HasField("temperature") and explicit.temperature == 0.0
    assert explicit.top_k == 0  # -1 ("disabled") is proto 0
    json_object = build_sampling_params(_chat(response_format={"type": "json_object"}),
                                        max_tokens=None, vocab_size=100)
    assert json_object.json_object
    completion = parse_request(CompletionRequest, {"prompt": "x", "logprobs": 2})
    assert completion.max_tokens == 16  # OpenAI's and vLLM's completions default
    assert build_sampling_params(completion, max_tokens=16, vocab_size=100).logprobs == 2


def test_context_window_limits() -> None:
    assert max_tokens_for(None, 10, 100) is None
    assert max_tokens_for(90, 10, 100) == 90
    with pytest.raises(InvalidRequest, match="max_tokens"):
        max_tokens_for(91, 10, 100)
    with pytest.raises(InvalidRequest, match="maximum context length"):
        max_tokens_for(None, 100, 100)


@pytest.mark.parametrize(("model", "body", "param"), [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "foo": 1}]},
     "messages.0.foo"),
    (ChatCompletionRequest, {"messages": MESSAGES, "stream_options": {"include_usage": True}},
     None),
    (ChatCompletionRequest, {"messages": MESSAGES, "top_logprobs": 2}, None),
    (ChatCompletionRequest, {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    (ChatCompletionRequest, {"messages": MESSAGES, "n": 0}, "n"),
    (ChatCompletionRequest, {"messages": MESSAGES, "seed": 2**40}, "seed"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
    (CompletionRequest, {"prompt": "x", "suffix": "y"}, "suffix"),
    (CompletionRequest, {"prompt": "x", "best_of": 3}, "best_of"),
    (CompletionRequest, {"prompt": ""}, None),
    (CompletionRequest, {}, "prompt"),
    (EmbeddingRequest, {"input": "x", "dimensions": 8}, "dimensions"),
])
def test_unknown_and_bad_fields_are_rejected(model: type, body: dict[str, Any],
                                             param: str | None) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(model, body)
    if param is not None:
        assert info.value.param == param
        assert param.split(".")[-1] in info.value.message


def test_unknown_top_level_fields_are_ignored_as_vllm_does() -> None:
    request = parse_request(ChatCompletionRequest, {"messages": MESSAGES, "functions": [],
                                                    "store": True, "n": 2})
    assert request.n == 2 and request.model_extra == {"functions": [], "store": True}
    assert parse_request(EmbeddingRequest, {"input": "x", "extra": 1}).inputs == ["x"]


def test_logit_bias_must_name_tokens_in_the_vocabulary() -> None:
    with pytest.raises(InvalidRequest, match="logit_bias"):
        build_sampling_params(_chat(logit_bias={"500": 1}), max_tokens=None, vocab_size=100)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        build_sampling_params(_chat(logit_bias={"abc": 1}), max_tokens=None, vocab_size=100)


def test_messages_reach_the_template_as_strings() -> None:
    request = _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]},
                              {"role": "assistant", "content": None, "tool_calls": [
                                  {"id": "1", "type": "function",
                                   "function": {"name": "f", "arguments": "{}"}}]}])
    first, second = (m.for_template() for m in request.messages)
    assert first == {"role": "user", "content": "a\nb"}
    assert second["content"] == "" and second["tool_calls"][0]["function"]["name"] == "f"
