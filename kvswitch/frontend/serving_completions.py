"""/v1/completions: tokenize the prompt(s), Generate, and shape OpenAI's text_completion.

A list of prompts runs one Generate per prompt; choice `index` is `prompt_index * n + i`, as in
OpenAI and vLLM. Token-id prompts are sent as they are.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from kvswitch.frontend.context import RequestContext, new_request_context
from kvswitch.frontend.engine_client import EngineClient
from kvswitch.frontend.generation import ChoiceDelta, Generation, prime
from kvswitch.frontend.logprobs import completion_logprobs
from kvswitch.frontend.metrics import FrontendMetrics
from kvswitch.frontend.openai_models import CompletionRequest, parse_request
from kvswitch.frontend.sampling import build_sampling_params, check_token_ids, max_tokens_for
from kvswitch.frontend.serving_models import ModelRegistry, ServedModel
from kvswitch.frontend.sse import CHUNK_END, choice_events, chunk_start
from kvswitch.limits import SAMPLING_DEFAULTS, SamplingCounts, check_sampling
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.tokenization.offload import encode_off_loop

__all__ = ["CompletionServing"]


class CompletionServing:
    def __init__(self, client: EngineClient, models: ModelRegistry, *,
                 user_as_fairness_id: bool = False,
                 metrics: FrontendMetrics | None = None) -> None:
        self._client = client
        self._metrics = metrics
        self._models = models
        self._user_as_fairness_id = user_as_fairness_id

    async def create(self, body: Any, headers: Mapping[str, str]
                     ) -> dict[str, Any] | AsyncIterator[bytes]:
        request = parse_request(CompletionRequest, body)
        model = await self._models.resolve(request.model)
        ctx = new_request_context(headers, prefix="cmpl", user=request.user,
                                  user_as_fairness_id=self._user_as_fairness_id,
                                  body_request_id=request.request_id, model=model.name)
        check_sampling(SamplingCounts(n=request.n, prompts=len(request.prompts_raw)),
                       SAMPLING_DEFAULTS)  # each prompt x n is a Generate call
        prompts: list[tuple[str, list[int]]] = []
        for raw in request.prompts_raw:
            if isinstance(raw, str):
                ids = await encode_off_loop(model.tokenizer, raw,
                                            add_special_tokens=request.add_special_tokens)
                prompts.append((raw, ids))
            else:
                check_token_ids(raw, model.vocab_size)  # before the tokenizer decodes them
                prompts.append((model.tokenizer.decode(list(raw)), list(raw)))
        grpc_requests = []
        for i, (_, ids) in enumerate(prompts):
            max_tokens = max_tokens_for(request.max_tokens, len(ids), model.max_model_len)
            params = build_sampling_params(request, max_tokens=max_tokens,
                                           vocab_size=model.vocab_size,
                                           defaults=model.sampling_defaults)
            suffix = f"-{i}" if len(prompts) > 1 else ""
            grpc_requests.append(pb.GenerateRequest(
                request_id=ctx.request_id + suffix, tokenized=pb.TokenizedInput(input_ids=ids),
                sampling_params=params, stream=bool(request.stream)))
        generation = Generation(self._client, model, grpc_requests, ctx.metadata, n=request.n)
        echoes = [text for text, _ in prompts] if request.echo else None
        if request.stream:
            deltas = await prime(generation.deltas())
            return self._stream(deltas, generation, request, model, ctx, echoes)
        return await self._full(generation, request, model, ctx, echoes)

    async def _full(self, generation: Generation, request: CompletionRequest,
                    model: ServedModel, ctx: RequestContext,
                    echoes: list[str] | None) -> dict[str, Any]:
        count = len(request.prompts_raw) * request.n
        texts: dict[int, list[str]] = {
            i: [echoes[i // request.n]] if echoes else [] for i in range(count)}
        finals: dict[int, ChoiceDelta] = {}
        logprobs: dict[int, dict[str, list[Any]]] = {}
        async for delta in generation.deltas():
            if delta.logprobs is not None and request.logprobs is not None:
                offset = sum(len(t) for t in texts[delta.index])
                part = completion_logprobs(model, delta.logprobs, offset)
                into = logprobs.setdefault(delta.index, {k: [] for k in part})
                for key, values in part.items():
                    into[key].extend(values)
            texts[delta.index].append(delta.text)
            if delta.finish_reason is not None:
                finals[delta.index] = delta
        choices = []
        for index in range(count):
            final = finals.get(index)
            choices.append({
                "index": index, "text": "".join(texts[index]),
                "logprobs": logprobs.get(index) if request.logprobs is not None else None,
                "finish_reason": final.finish_reason if final else "abort",
                "stop_reason": final.stop_reason if final else None,
            })
        self._record(generation)
        return {"id": ctx.request_id, "object": "text_completion", "created": ctx.created,
                "model": model.name, "choices": choices, "usage": generation.usage.as_dict(),
                "system_fingerprint": None}

    def _stream(self, deltas: AsyncIterator[ChoiceDelta], generation: Generation,
                request: CompletionRequest, model: ServedModel, ctx: RequestContext,
                echoes: list[str] | None) -> AsyncIterator[bytes]:
        head = orjson.dumps({"id": ctx.request_id, "object": "text_completion",
                             "created": ctx.created, "model": model.name})
        start = chunk_start(head)
        offsets: dict[int, int] = {}
        # Echoed prompts go out with the first delta (already here: `prime` waited for it).
        lead = b""
        if echoes:
            for index in range(len(echoes) * request.n):
                text = echoes[index // request.n]
                offsets[index] = len(text)
                lead += start + orjson.dumps({"index": index, "text": text, "logprobs": None,
                                              "finish_reason": None}) + CHUNK_END
        want_logprobs = request.logprobs is not None

        def choice_of(delta: ChoiceDelta) -> dict[str, Any]:
            logprobs = None
            if want_logprobs and delta.logprobs is not None:
                logprobs = completion_logprobs(model, delta.logprobs,
                                               offsets.get(delta.index, 0))
                offsets[delta.index] = offsets.get(delta.index, 0) + len(delta.text)
            return {"index": delta.index, "text": delta.text, "logprobs": logprobs,
                    "finish_reason": delta.finish_reason}

        return choice_events(deltas, generation, head, lead, choice_of, request.include_usage,
                             self._record)

    def _record(self, generation: Generation) -> None:
        if self._metrics is not None:
            self._metrics.usage(generation.usage)
