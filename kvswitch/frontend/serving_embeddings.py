"""/v1/embeddings: tokenize each input and call Embed for each, concurrently."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Mapping
from typing import Any

from kvswitch.errors import InvalidRequest
from kvswitch.frontend.context import new_request_context
from kvswitch.frontend.engine_client import EngineClient
from kvswitch.frontend.openai_models import EmbeddingRequest, parse_request
from kvswitch.frontend.sampling import check_token_ids
from kvswitch.frontend.serving_models import ModelRegistry
from kvswitch.limits import SAMPLING_DEFAULTS, SamplingCounts, check_sampling
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.tokenization.offload import encode_off_loop

__all__ = ["EmbeddingServing"]


class EmbeddingServing:
    def __init__(self, client: EngineClient, models: ModelRegistry, *,
                 user_as_fairness_id: bool = False) -> None:
        self._client = client
        self._models = models
        self._user_as_fairness_id = user_as_fairness_id

    async def create(self, body: Any, headers: Mapping[str, str]) -> dict[str, Any]:
        request = parse_request(EmbeddingRequest, body)
        model = await self._models.resolve(request.model)
        ctx = new_request_context(headers, prefix="embd", user=request.user,
                                  user_as_fairness_id=self._user_as_fairness_id,
                                  body_request_id=request.request_id, model=model.name)
        check_sampling(SamplingCounts(prompts=len(request.inputs), prompts_field="input"),
                       SAMPLING_DEFAULTS)
        token_lists = []
        for item in request.inputs:
            ids = (await encode_off_loop(model.tokenizer, item,
                                         add_special_tokens=request.add_special_tokens)
                   if isinstance(item, str) else list(item))
            if not ids:
                raise InvalidRequest("input cannot be empty", param="input")
            check_token_ids(ids, model.vocab_size, param="input")
            if len(ids) > model.max_model_len:
                raise InvalidRequest(
                    f"This model's maximum context length is {model.max_model_len} tokens. "
                    f"However, you requested {len(ids)} tokens in the input for embedding "
                    "generation. Please reduce the length of the input.", param="input")
            token_lists.append(ids)
        replies = await asyncio.gather(*(
            self._client.embed(pb.EmbedRequest(request_id=f"{ctx.request_id}-{i}",
                                               tokenized=pb.TokenizedInput(input_ids=ids)),
                               ctx.metadata)
            for i, ids in enumerate(token_lists)))
        data = []
        for index, reply in enumerate(replies):
            vector: Any = list(reply.embedding)
            if request.encoding_format == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": vector})
        prompt_tokens = sum(r.prompt_tokens or len(ids) for r, ids in zip(replies, token_lists))
        return {"id": ctx.request_id, "object": "list", "created": ctx.created,
                "model": model.name, "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                          "completion_tokens": 0, "prompt_tokens_details": None}}
