"""OpenAI request models (with vLLM's extensions), validated strictly.

Unknown top-level fields are accepted and ignored, as vLLM does (each name is logged once per
process); inside a request (messages, tools, formats) every model forbids unknown fields. A
field kvswitch knows but cannot honour (`suffix`, `best_of` > 1, `dimensions`) is refused with
a 400 that names it. `parse_request` turns pydantic's errors into `InvalidRequest(param=...)`.
Responses are plain dicts built in the serving modules, serialised with orjson.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvswitch.errors import InvalidRequest

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "EmbeddingRequest",
    "NamedToolChoice",
    "RequestBody",
    "ResponseFormat",
    "StreamOptions",
    "StrictModel",
    "StructuredOutputs",
    "parse_request",
]

logger = logging.getLogger(__name__)

_INT32 = 2**31 - 1


class StrictModel(BaseModel):
    """A part of a request: unknown fields are a 400."""

    model_config = ConfigDict(extra="forbid", frozen=False, protected_namespaces=())


class RequestBody(BaseModel):
    """A request body: unknown fields are kept aside (`model_extra`) and ignored."""

    model_config = ConfigDict(extra="allow", frozen=False, protected_namespaces=())


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    continuous_usage_stats: Literal[False] | None = False


class JsonSchema(StrictModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or
                                           self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` (StructuredOutputsParams): exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # Backend tuning vLLM accepts; the engine API has no field for them.
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str | dict[str, Any]


class ToolCall(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """As vLLM hands it to templates: arguments sent as a JSON string become an object
        (templates write `arguments | tojson`)."""
        call = self.model_dump(exclude_none=True)
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                call["function"]["arguments"] = json.loads(arguments)
            except (ValueError, RecursionError):
                pass  # not JSON (or nested past Python's limit): the template gets the text
        return call


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    """vLLM's current name for `reasoning_content` (either reaches the template as the latter)."""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: text parts joined, content never None."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thought = self.reasoning_content if self.reasoning_content is not None else \
            self.reasoning
        if thought is not None:
            message["reasoning_content"] = thought
        return message


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _SamplingFields(RequestBody):
    """Fields shared by chat and completions (OpenAI's and vLLM's extra sampling params)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: Annotated[int, Field(ge=-_INT32 - 1, le=_INT32)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    request_id: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extensions
    include_reasoning: bool = True
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true")
        return self

    def check(self) -> None:
        """Checks across fields that name the field at fault (`parse_request` runs them)."""
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        if forced and not self.tools:
            raise InvalidRequest("tool_choice `required` or a named function needs `tools`",
                                 param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools and \
                self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            raise InvalidRequest(f"tool_choice names the function "
                                 f"'{self.tool_choice.function.name}', which is not in tools",
                                 param="tool_choice")

    @property
    def parses_tools(self) -> bool:
        """The output may hold tool calls to parse (tools given, tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def named_tool(self) -> str | None:
        """The function a named tool_choice forces."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: Literal[1] | None = None
    suffix: None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _prompt_not_empty(self) -> CompletionRequest:
        if self.prompt == "" or self.prompt == [] or any(p in ("", []) for p in self.prompts_raw):
            raise ValueError("prompt cannot be empty")
        return self

    @property
    def prompts_raw(self) -> list[str | list[int]]:
        return prompt_list(self.prompt)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = None
    user: str | None = None
    add_special_tokens: bool = True
    request_id: str | None = None

    @property
    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input)


def prompt_list(value: PromptInput) -> list[str | list[int]]:
    """One prompt (a text or token ids) or a list of them, as a list of prompts."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


_LOGGED_IGNORED: set[str] = set()
_MAX_LOGGED_IGNORED = 256


def _log_ignored(extra: dict[str, Any]) -> None:
    new = [name for name in extra if name not in _LOGGED_IGNORED]
    if new and len(_LOGGED_IGNORED) < _MAX_LOGGED_IGNORED:
        _LOGGED_IGNORED.update(new)
        logger.warning("request fields ignored (kvswitch, like vLLM, accepts unknown "
                       "fields): %s", ", ".join(sorted(new)))


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "literal"})
_Model = TypeVar("_Model", bound=BaseModel)


def parse_request(model: type[_Model], body: Any) -> _Model:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        # Union branches add type tags ("str", "list[int]", "function-after[...]") to the path.
        loc = [str(part) for part in error["loc"]
               if not (isinstance(part, str)
                       and (part in _TYPE_TAGS or "[" in part or "-" in part))]
        param = ".".join(loc) or None
        if error["type"] == "extra_forbidden":
            message = f"Unsupported field '{param}': kvswitch does not implement it"
        elif error["type"] == "missing":
            message = f"Missing required field '{param}'"
        else:
            message = f"Invalid value for '{param}': {error['msg']}" if param else error["msg"]
        raise InvalidRequest(message, param=param) from None
    if request.model_extra:
        _log_ignored(request.model_extra)
    check = getattr(request, "check", None)
    if check is not None:
        check()
    return request
