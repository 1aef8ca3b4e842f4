"""OpenAI sampling fields -> the engine's `SamplingParams` proto.

Unset fields fall back to the model's defaults (GetModelInfo.default_sampling_params_json, as
vLLM applies generation_config.json), then to vLLM's. `max_tokens` is capped by what the context
window leaves after the prompt; a prompt that fills the window is refused with vLLM's message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from kvswitch.errors import InvalidRequest
from kvswitch.frontend.openai_models import ChatCompletionRequest, CompletionRequest
from kvswitch.protocol import vllm_engine_pb2 as pb

__all__ = ["build_sampling_params", "check_token_ids", "max_tokens_for", "structured_constraint"]

# Request field -> the proto field it fills when the model's defaults name it.
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty")


def max_tokens_for(requested: int | None, prompt_len: int, max_model_len: int) -> int | None:
    """Check the request's output budget against the room the prompt leaves in the context
    window. None stays None: the engine then generates until eos or the window is full."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input "
            "messages.", param="messages")
    if requested is not None and requested > room:
        raise InvalidRequest(
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's "
            f"maximum context length is {max_model_len} tokens and your request has "
            f"{prompt_len} input tokens ({requested} > {max_model_len} - {prompt_len}).",
            param="max_tokens")
    return requested


def _logprobs(request: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        if not request.logprobs:
            return None
        return request.top_logprobs or 0
    return request.logprobs


def _logit_bias(bias: Mapping[str, float], vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id",
                                 param="logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"logit_bias token id {token_id} is out of vocabulary "
                                 f"(size {vocab_size})", param="logit_bias")
        out[token_id] = value
    return out


_UINT32_MAX = 2**32 - 1


def _uint32(name: str, value: int) -> int:
    # The proto's uint32 fields: a larger value would fail the assignment with a ValueError.
    if not 0 <= value <= _UINT32_MAX:
        raise InvalidRequest(f"'{name}' is out of range: {value}", param=name)
    return value


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    """Every id in [0, vocab_size), as vLLM's input processor requires (400 otherwise)."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"Token id {token_id} is out of vocabulary (size "
                                 f"{vocab_size}).", param=param)


def build_sampling_params(request: ChatCompletionRequest | CompletionRequest, *,
                          max_tokens: int | None, vocab_size: int,
                          defaults: Mapping[str, Any] | None = None) -> pb.SamplingParams:
    """Map the request's sampling fields; `max_tokens` is already capped (`max_tokens_for`)."""
    _uint32("min_tokens", request.min_tokens)
    for token_id in request.stop_token_ids or ():
        _uint32("stop_token_ids", token_id)
    params = pb.SamplingParams(
        min_tokens=request.min_tokens,
        n=request.n,
        stop=request.stop_list,
        stop_token_ids=request.stop_token_ids or (),
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
    )
    if max_tokens is not None:
        params.max_tokens = max_tokens
    if max_tokens is not None and request.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({request.min_tokens}) must be at most max_tokens "
                             f"({max_tokens})", param="min_tokens")
    chosen = {name: getattr(request, name) for name in _DEFAULTABLE}
    for name, value in (defaults or {}).items():
        if name in chosen and chosen[name] is None:
            chosen[name] = value
    if chosen["temperature"] is not None:
        params.temperature = float(chosen["temperature"])
    if chosen["top_p"] is not None:
        params.top_p = float(chosen["top_p"])
    if chosen["top_k"] is not None and chosen["top_k"] > 0:
        params.top_k = _uint32("top_k", int(chosen["top_k"]))  # -1, 0: "disabled" (proto 0)
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if chosen[name] is not None:
            setattr(params, name, float(chosen[name]))
    if request.seed is not None:
        params.seed = request.seed
    logprobs = _logprobs(request)
    if logprobs is not None:
        params.logprobs = logprobs
    if request.logit_bias:
        params.logit_bias.update(_logit_bias(request.logit_bias, vocab_size))
    constraint = structured_constraint(request)
    if constraint is not None:
        kind, value = constraint
        if kind == "choice":
            params.choice.choices.extend(value)
        else:
            setattr(params, kind, value)
    return params


def _schema_text(schema: str | dict[str, Any], param: str) -> str:
    if isinstance(schema, str):
        try:
            orjson.loads(schema)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"{param} is not valid JSON: {exc}", param=param) from None
        return schema
    return orjson.dumps(schema).decode()


def structured_constraint(request: ChatCompletionRequest | CompletionRequest
                          ) -> tuple[str, Any] | None:
    """The one structured-output constraint a request sets, as (SamplingParams field, value):
    from `response_format`, vLLM's `structured_outputs` or its older `guided_*` fields. More
    than one is a 400, as in vLLM."""
    found: list[tuple[str, str, Any]] = []  # (request field, proto field, value)
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(("response_format", "json_object", True))
    elif response_format is not None and response_format.type == "json_schema":
        assert response_format.json_schema is not None  # checked by the model
        found.append(("response_format", "json_schema",
                      orjson.dumps(response_format.json_schema.schema_).decode()))
    outputs = request.structured_outputs
    if outputs is not None:
        for name, field_name in (("json_", "json_schema"), ("regex", "regex"),
                                 ("choice", "choice"), ("grammar", "grammar"),
                                 ("json_object", "json_object"),
                                 ("structural_tag", "structural_tag")):
            value = getattr(outputs, name)
            if value is None or value is False:
                continue
            if name == "json_":
                name, value = "json", _schema_text(value, "structured_outputs.json")
            found.append((f"structured_outputs.{name}", field_name, value))
    if request.guided_json is not None:
        found.append(("guided_json", "json_schema",
                      _schema_text(request.guided_json, "guided_json")))
    for name, field_name in (("guided_regex", "regex"), ("guided_choice", "choice"),
                             ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            found.append((name, field_name, value))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequest("only one kind of structured output may be requested; got "
                             + ", ".join(name for name, _, _ in found), param=found[1][0])
    return found[0][1], found[0][2]


def parse_default_sampling(raw: str) -> dict[str, Any]:
    """GetModelInfo.default_sampling_params_json, tolerating an empty or foreign value."""
    if not raw:
        return {}
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return {k: v for k, v in value.items() if k in _DEFAULTABLE} if isinstance(value, dict) else {}
