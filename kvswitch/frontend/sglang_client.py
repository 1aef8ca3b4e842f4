"""The frontend's calls on an SGLang pool: vLLM-shaped requests and answers <-> SGLang's.

The frontend builds and reads the vLLM engine API's messages; against a
`sglang.grpc.scheduler.SglangScheduler` target (`kvswitch frontend --api sglang`, or found:
`EngineClient` asks GetModelInfo of vLLM's service first and an UNIMPLEMENTED answer means
SGLang) each call is translated here, field by field:
- GenerateRequest: tokenized ids; SamplingParams with SGLang's explicit defaults (temperature 1
  when unset, top_k -1 for "disabled"), max_tokens -> max_new_tokens, min_tokens ->
  min_new_tokens, include_stop_str_in_output -> no_stop_trim, logprobs -> return_logprob +
  top_logprobs_num, prompt_logprobs -> logprob_start_len 0, grammar -> ebnf_grammar, a choice
  -> a regex of its alternatives, json_object -> the schema `{"type": "object"}`. SGLang's
  scheduler API takes no seed: a seeded request is sampled unseeded.
- GenerateResponse: SGLang's chunks carry cumulative completion counts and vLLM's carry the
  chunk's own, so a chunk's count becomes its ids' length; a `complete` keeps its ids (the last
  delta when streamed, all of them otherwise) and counts them the same way. Logprob messages
  are the same on the wire in both APIs and are copied as bytes.
- GetModelInfo, Embed, HealthCheck: the fields both APIs name alike.
"""

from __future__ import annotations

import re
from typing import Any

from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.sglang import sglang_method_path
from kvswitch.protocol.sglang import sglang_scheduler_pb2 as spb

__all__ = [
    "GENERATE_PATH", "embed_request", "embed_response", "generate_request", "generate_response",
    "model_info", "parse_generate_response",
]

GENERATE_PATH = sglang_method_path("Generate")


def _sampling(p: pb.SamplingParams) -> spb.SamplingParams:
    out = spb.SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p or 1.0, top_k=p.top_k if p.top_k else -1, min_p=p.min_p,
        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
        n=p.n or 1, min_new_tokens=p.min_tokens, ignore_eos=p.ignore_eos,
        no_stop_trim=p.include_stop_str_in_output,
        logit_bias={str(k): v for k, v in p.logit_bias.items()})
    if p.HasField("max_tokens"):
        out.max_new_tokens = p.max_tokens
    kind = p.WhichOneof("constraint")
    if kind in ("json_schema", "regex", "structural_tag"):
        setattr(out, kind, getattr(p, kind))
    elif kind == "grammar":
        out.ebnf_grammar = p.grammar
    elif kind == "choice":
        out.regex = "|".join(f"(?:{re.escape(c)})" for c in p.choice.choices)
    elif kind == "json_object" and p.json_object:
        out.json_schema = '{"type": "object"}'
    return out


def generate_request(request: pb.GenerateRequest) -> spb.GenerateRequest:
    out = spb.GenerateRequest(
        request_id=request.request_id, stream=request.stream,
        tokenized=spb.TokenizedInput(original_text=request.tokenized.original_text,
                                     input_ids=request.tokenized.input_ids),
        sampling_params=_sampling(request.sampling_params), logprob_start_len=-1)
    params = request.sampling_params
    if params.HasField("logprobs") or params.HasField("prompt_logprobs"):
        out.return_logprob = True
        out.top_logprobs_num = max(params.logprobs, params.prompt_logprobs, 0)
        if params.HasField("prompt_logprobs"):
            out.logprob_start_len = 0
    if request.WhichOneof("input") == "text":
        out.tokenized.original_text = request.text
    return out


def _copy(src: Any, dst: Any) -> Any:
    """Logprob messages are the same on the wire in both APIs."""
    dst.MergeFromString(src.SerializeToString())
    return dst


def generate_response(message: spb.GenerateResponse) -> pb.GenerateResponse:
    if message.HasField("chunk"):
        c = message.chunk
        chunk = pb.GenerateStreamChunk(
            token_ids=c.token_ids, prompt_tokens=c.prompt_tokens,
            completion_tokens=len(c.token_ids), cached_tokens=c.cached_tokens, index=c.index)
        if c.HasField("output_logprobs"):
            _copy(c.output_logprobs, chunk.output_logprobs)
        if c.HasField("input_logprobs"):
            _copy(c.input_logprobs, chunk.input_logprobs)
        return pb.GenerateResponse(chunk=chunk)
    d = message.complete
    complete = pb.GenerateComplete(
        output_ids=d.output_ids, finish_reason=d.finish_reason, prompt_tokens=d.prompt_tokens,
        completion_tokens=len(d.output_ids), cached_tokens=d.cached_tokens, index=d.index)
    which = d.WhichOneof("matched_stop")
    if which is not None:
        setattr(complete, which, getattr(d, which))
    if d.HasField("output_logprobs"):
        _copy(d.output_logprobs, complete.output_logprobs)
    if d.HasField("input_logprobs"):
        _copy(d.input_logprobs, complete.input_logprobs)
    return pb.GenerateResponse(complete=complete)


def parse_generate_response(data: bytes) -> pb.GenerateResponse:
    return generate_response(spb.GenerateResponse.FromString(data))


def embed_request(request: pb.EmbedRequest) -> spb.EmbedRequest:
    return spb.EmbedRequest(request_id=request.request_id, tokenized=spb.TokenizedInput(
        original_text=request.tokenized.original_text, input_ids=request.tokenized.input_ids))


def embed_response(message: spb.EmbedResponse) -> pb.EmbedResponse:
    return pb.EmbedResponse(embedding=message.embedding, prompt_tokens=message.prompt_tokens,
                            embedding_dim=message.embedding_dim)


def model_info(message: spb.GetModelInfoResponse) -> pb.GetModelInfoResponse:
    """The fields both APIs name alike."""
    out = pb.GetModelInfoResponse()
    names = set(out.DESCRIPTOR.fields_by_name)
    for field, value in message.ListFields():
        if field.name in names:
            target = getattr(out, field.name)
            if hasattr(target, "extend"):  # a repeated field
                target.extend(value)
            else:
                setattr(out, field.name, value)
    return out
