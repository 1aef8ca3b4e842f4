"""/tokenize and /detokenize, as vLLM serves them (no /v1 prefix).

/tokenize takes a completion-style `prompt` or chat `messages` (rendered through the chat
template as /v1/chat/completions renders them) and answers `{"count", "max_model_len",
"tokens", "token_strs"}`; /detokenize takes `tokens` and answers `{"prompt"}`. Token ids outside
the vocabulary are a 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field

from kvswitch.errors import InvalidRequest
from kvswitch.frontend.logprobs import token_text
from kvswitch.frontend.openai_models import ChatMessage, RequestBody, Tool, parse_request
from kvswitch.frontend.serving_chat import render_chat_prompt
from kvswitch.frontend.serving_models import ModelRegistry
from kvswitch.tokenization.offload import encode_off_loop

__all__ = ["TokenizeServing"]


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give either `prompt` or `messages`", param="prompt")


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class TokenizeServing:
    def __init__(self, models: ModelRegistry) -> None:
        self._models = models

    async def tokenize(self, body: Any, headers: Mapping[str, str]) -> dict[str, Any]:
        request = parse_request(TokenizeRequest, body)
        model = await self._models.resolve(request.model)
        if request.messages is not None:
            text = render_chat_prompt(
                model, request.messages, chat_template=request.chat_template,
                tools=request.tools, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs)
            special = bool(request.add_special_tokens)  # chat: the template has them
        else:
            assert request.prompt is not None
            text = request.prompt
            special = request.add_special_tokens is not False
        ids = await encode_off_loop(model.tokenizer, text, add_special_tokens=special)
        strs = ([token_text(model, i) for i in ids]
                if request.return_token_strs else None)
        return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, body: Any, headers: Mapping[str, str]) -> dict[str, Any]:
        request = parse_request(DetokenizeRequest, body)
        model = await self._models.resolve(request.model)
        bad = next((t for t in request.tokens if t >= model.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is out of vocabulary (size "
                                 f"{model.vocab_size})", param="tokens")
        return {"prompt": model.tokenizer.decode(request.tokens)}
