"""/v1/chat/completions: render the chat template, tokenize, Generate, and shape the answer.

Each choice's text goes through the reasoning and tool-call parsers `chat_output` picks for
the request (message fields `reasoning_content`, `tool_calls`). Streaming follows what the
OpenAI SDK expects (and vLLM sends): per choice a first chunk with
`{"role": "assistant", "content": ""}`, then content / reasoning_content / tool_calls deltas (one
SSE event per engine message, however many tokens it carries; none while a parser holds text
back), a chunk with `finish_reason`, optionally a usage chunk with no choices, then
`data: [DONE]`. Each event is a pre-built prefix + one orjson-encoded choice. `start` and `full`
also serve /v1/messages.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from kvswitch.errors import InvalidRequest
from kvswitch.frontend.chat_output import ChatOutputPlan, ParserSettings, plan_chat_output
from kvswitch.frontend.context import RequestContext, new_request_context
from kvswitch.frontend.engine_client import EngineClient
from kvswitch.frontend.generation import ChoiceDelta, Generation, prime
from kvswitch.frontend.logprobs import chat_logprobs
from kvswitch.frontend.metrics import FrontendMetrics
from kvswitch.frontend.openai_models import ChatCompletionRequest, ChatMessage, Tool, parse_request
from kvswitch.frontend.parsing import ChoiceOutput, ParsedDelta
from kvswitch.frontend.sampling import build_sampling_params, max_tokens_for
from kvswitch.frontend.serving_models import ModelRegistry, ServedModel
from kvswitch.frontend.sse import CHUNK_END, choice_events, chunk_start
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.tokenization.chat_template import ChatTemplate
from kvswitch.tokenization.offload import encode_off_loop

__all__ = ["ChatRun", "ChatServing", "render_chat_prompt"]


def render_chat_prompt(model: ServedModel, messages: Sequence[ChatMessage], *,
                       chat_template: str | None, tools: Sequence[Tool] | None,
                       add_generation_prompt: bool, continue_final_message: bool,
                       chat_template_kwargs: Mapping[str, Any] | None,
                       documents: Sequence[Mapping[str, str]] | None = None) -> str:
    """The prompt text of a chat request (the request's template, else the model's)."""
    if chat_template is not None:
        template = ChatTemplate.from_bundle(model.tokenizer, chat_template)
    elif model.chat_template is not None:
        template = model.chat_template
    else:
        raise InvalidRequest("the model's tokenizer has no chat template; pass chat_template",
                             param="chat_template")
    return template.render(
        [m.for_template() for m in messages], add_generation_prompt=add_generation_prompt,
        tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
        documents=documents, continue_final_message=continue_final_message,
        extra=chat_template_kwargs)


@dataclass(frozen=True)
class ChatRun:
    """A chat request ready to run: its model, identity, output parsing and Generate call."""

    request: ChatCompletionRequest
    model: ServedModel
    ctx: RequestContext
    plan: ChatOutputPlan
    generation: Generation


class ChatServing:
    def __init__(self, client: EngineClient, models: ModelRegistry, *,
                 user_as_fairness_id: bool = False,
                 metrics: FrontendMetrics | None = None,
                 parsers: ParserSettings | None = None) -> None:
        self._client = client
        self._parsers = parsers or ParserSettings()
        self._metrics = metrics
        self._models = models
        self._user_as_fairness_id = user_as_fairness_id

    async def create(self, body: Any, headers: Mapping[str, str]
                     ) -> dict[str, Any] | AsyncIterator[bytes]:
        """A response body (dict) or, for stream=true, the SSE events."""
        request = parse_request(ChatCompletionRequest, body)
        run = await self.start(request, headers)
        if request.stream:
            deltas = await prime(run.generation.deltas())
            return self._stream(deltas, run.generation, request, run.model, run.ctx, run.plan)
        return await self.full(run)

    async def start(self, request: ChatCompletionRequest, headers: Mapping[str, str], *,
                    prefix: str = "chatcmpl") -> ChatRun:
        """Render, tokenize and set up the Generate call (not started yet) of a request."""
        model = await self._models.resolve(request.model)
        ctx = new_request_context(headers, prefix=prefix, user=request.user,
                                  user_as_fairness_id=self._user_as_fairness_id,
                                  body_request_id=request.request_id, model=model.name)
        prompt_ids = await self.prompt_ids(request, model)
        max_tokens = max_tokens_for(request.requested_max_tokens, len(prompt_ids),
                                    model.max_model_len)
        params = build_sampling_params(request, max_tokens=max_tokens,
                                       vocab_size=model.vocab_size,
                                       defaults=model.sampling_defaults)
        plan = plan_chat_output(request, self._parsers, model.tokenizer.chat_template)
        if plan.forced_schema is not None:
            if params.WhichOneof("constraint") is not None:
                raise InvalidRequest("tool_choice `required` or a named function cannot be "
                                     "combined with another structured-output constraint",
                                     param="tool_choice")
            params.json_schema = orjson.dumps(plan.forced_schema).decode()
        grpc_request = pb.GenerateRequest(
            request_id=ctx.request_id, tokenized=pb.TokenizedInput(input_ids=prompt_ids),
            sampling_params=params, stream=bool(request.stream))
        generation = Generation(self._client, model, [grpc_request], ctx.metadata, n=request.n)
        return ChatRun(request, model, ctx, plan, generation)

    @staticmethod
    async def prompt_ids(request: ChatCompletionRequest, model: ServedModel) -> list[int]:
        """The request's prompt: its messages through the chat template, tokenized."""
        text = render_chat_prompt(
            model, request.messages, chat_template=request.chat_template,
            tools=request.tools if request.tool_choice != "none" else None,
            documents=request.documents, add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs)
        return await encode_off_loop(model.tokenizer, text,
                                     add_special_tokens=request.add_special_tokens)

    async def full(self, run: ChatRun) -> dict[str, Any]:
        """The whole chat.completion response of a started request."""
        generation, request, model, ctx, plan = (run.generation, run.request, run.model,
                                                 run.ctx, run.plan)
        texts: dict[int, list[str]] = {i: [] for i in range(request.n)}
        finals: dict[int, ChoiceDelta] = {}
        logprobs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(request.n)}
        async for delta in generation.deltas():
            texts[delta.index].append(delta.text)
            if delta.logprobs is not None:
                logprobs[delta.index].extend(chat_logprobs(model, delta.logprobs)["content"])
            if delta.finish_reason is not None:
                finals[delta.index] = delta
        choices = []
        for index in range(request.n):
            final = finals.get(index)
            reason = final.finish_reason if final and final.finish_reason else "abort"
            text = "".join(texts[index])
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None,
                                       "tool_calls": []}
            if plan.new_choice is not None:
                output = plan.new_choice()
                parsed = output.feed(text)
                parsed.extend(output.finish())
                message.update(_message_fields(parsed, plan))
                reason = finish_reason_of(reason, output, plan)
            choices.append({
                "index": index,
                "message": message,
                "logprobs": {"content": logprobs[index]} if request.logprobs else None,
                "finish_reason": reason,
                "stop_reason": final.stop_reason if final else None,
            })
        self.record(generation)
        return {"id": ctx.request_id, "object": "chat.completion", "created": ctx.created,
                "model": model.name, "choices": choices,
                "usage": generation.usage.as_dict(), "system_fingerprint": None}

    def _stream(self, deltas: AsyncIterator[ChoiceDelta], generation: Generation,
                request: ChatCompletionRequest, model: ServedModel,
                ctx: RequestContext, plan: ChatOutputPlan) -> AsyncIterator[bytes]:
        head = orjson.dumps({"id": ctx.request_id, "object": "chat.completion.chunk",
                             "created": ctx.created, "model": model.name})
        start = chunk_start(head)
        # The role chunks go out with the first delta (already here: `prime` waited for it).
        lead = b"".join(start + orjson.dumps({"index": index, "delta": {"role": "assistant",
                                                                        "content": ""},
                                              "logprobs": None, "finish_reason": None})
                        + CHUNK_END for index in range(request.n))
        want_logprobs = bool(request.logprobs)
        new_choice = plan.new_choice
        outputs: dict[int, ChoiceOutput] = {}

        def choice_of(delta: ChoiceDelta) -> dict[str, Any] | None:
            lp = (chat_logprobs(model, delta.logprobs)
                  if want_logprobs and delta.logprobs is not None else None)
            reason = delta.finish_reason
            output = outputs.get(delta.index) if new_choice is not None else None
            if output is None and new_choice is not None:
                output = outputs[delta.index] = new_choice()
            if output is None or output.passthrough:  # plain text: the parsers have nothing
                body = {"content": delta.text} if delta.text else {}  # to hold or split
            else:
                parsed = output.feed(delta.text)
                if reason is not None:
                    parsed.extend(output.finish())
                    reason = finish_reason_of(reason, output, plan)
                body = parsed.as_stream_dict()
                if not body and reason is None and lp is None:
                    return None  # held back (a marker may be arriving): nothing to send yet
            return {"index": delta.index, "delta": body, "logprobs": lp,
                    "finish_reason": reason}

        return choice_events(deltas, generation, head, lead, choice_of, request.include_usage,
                             self.record)

    def record(self, generation: Generation) -> None:
        """Count a finished generation's usage in the metrics."""
        if self._metrics is not None:
            self._metrics.usage(generation.usage)


def _message_fields(parsed: ParsedDelta, plan: ChatOutputPlan) -> dict[str, Any]:
    """A parsed choice's message fields: content (None when empty), tool calls, reasoning."""
    calls: dict[int, dict[str, Any]] = {}
    for piece in parsed.calls:
        call = calls.get(piece.index)
        if call is None:
            call = calls[piece.index] = {"id": piece.id, "type": "function",
                                         "function": {"name": piece.name, "arguments": ""}}
        call["function"]["arguments"] += piece.arguments
    fields: dict[str, Any] = {"content": parsed.content or None,
                              "tool_calls": [calls[i] for i in sorted(calls)]}
    if plan.reasoning:  # both names: vLLM's current one and the one SMG and older vLLM use
        fields["reasoning"] = fields["reasoning_content"] = parsed.reasoning or None
    return fields


def finish_reason_of(reason: str, output: ChoiceOutput, plan: ChatOutputPlan) -> str:
    return "tool_calls" if output.tool_calls and plan.tool_calls_finish and reason == "stop" \
        else reason
