"""Protobuf (vLLM gRPC engine API) <-> the `Engine` contract, with vLLM's validation.

Requests: `sampling_from_proto` reproduces vLLM's `_sampling_params_from_proto` defaults
(temperature 1.0 when unset, top_p 0 -> 1, repetition_penalty 0 -> 1, n 0 -> 1, max_tokens
optional) and then the checks vLLM's `SamplingParams` and input processor make, raising
`InvalidRequest` with vLLM's wording, which always names the field at fault.

Responses: `ResponseBuilder` turns `GenerationUpdate`s into `GenerateResponse`s shaped as
vLLM's servicer shapes them (DELTA chunks per index, a `complete` per index).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvswitch.engine import logprobs
from kvswitch.engine.base import (
    GenerationUpdate,
    ModelCard,
    SamplingOptions,
    SequenceDelta,
    TokenLogprob,
)
from kvswitch.errors import InvalidRequest
from kvswitch.limits import (
    SAMPLING_DEFAULTS,
    SamplingLimits,
    check_sampling,
    proto_sampling_counts,
)
from kvswitch.protocol import vllm_engine_pb2 as pb

# vLLM's default --max-logprobs (`kvswitch engine --max-logprobs`).
MAX_LOGPROBS = SAMPLING_DEFAULTS.max_logprobs
# A client that casts top_k = -1 ("disabled", as vLLM accepts it) to uint32 sends this.
_UINT32_MINUS_ONE = 2**32 - 1


def sampling_from_proto(params: pb.SamplingParams, card: ModelCard,
                        limits: SamplingLimits = SAMPLING_DEFAULTS) -> SamplingOptions:
    """Convert and validate; raises `InvalidRequest` naming the bad field."""
    check_sampling(proto_sampling_counts(params), limits)
    top_k = 0 if params.top_k == _UINT32_MINUS_ONE else int(params.top_k)
    options = SamplingOptions(
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        min_tokens=params.min_tokens,
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p if params.top_p != 0.0 else 1.0,
        top_k=top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 0.0 else 1.0,
        seed=params.seed if params.HasField("seed") else None,
        n=params.n if params.n > 0 else 1,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        prompt_logprobs=params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
        logit_bias=dict(params.logit_bias),
        constraint=_constraint(params),
    )
    validate_sampling(options, card, limits.max_logprobs)
    return options


def _constraint(params: pb.SamplingParams) -> tuple[str, str] | None:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return kind, json.dumps(list(params.choice.choices))
    if kind == "json_object":
        return kind, "true" if params.json_object else "false"
    return kind, str(getattr(params, kind))


def validate_sampling(o: SamplingOptions, card: ModelCard,
                      max_logprobs: int = MAX_LOGPROBS) -> None:
    """vLLM's `SamplingParams._verify_args` plus the engine's logprob and logit-bias limits."""
    _require(-2.0 <= o.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {o.presence_penalty}.")
    _require(-2.0 <= o.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {o.frequency_penalty}.")
    _require(o.repetition_penalty > 0.0, "repetition_penalty",
             f"repetition_penalty must be greater than zero, got {o.repetition_penalty}.")
    _require(o.temperature >= 0.0, "temperature",
             f"temperature must be non-negative, got {o.temperature}.")
    _require(0.0 < o.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {o.top_p}.")
    _require(o.top_k <= card.vocab_size, "top_k",
             f"top_k must be 0 (disable), or at least 1 and at most the vocabulary size "
             f"{card.vocab_size}, got {o.top_k}.")
    _require(0.0 <= o.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {o.min_p}.")
    if o.max_tokens is not None:
        _require(o.max_tokens >= 1, "max_tokens",
                 f"max_tokens must be at least 1, got {o.max_tokens}.")
        _require(o.min_tokens <= o.max_tokens, "min_tokens",
                 f"min_tokens must be less than or equal to max_tokens={o.max_tokens}, "
                 f"got {o.min_tokens}.")
    _check_logprobs(o.logprobs, "logprobs", "sample", card, max_logprobs)
    _check_logprobs(o.prompt_logprobs, "prompt_logprobs", "prompt", card, max_logprobs)
    _require(all(o.stop), "stop", "stop cannot contain an empty string.")
    bad_stop_ids = [t for t in o.stop_token_ids if t >= card.vocab_size]
    _require(not bad_stop_ids, "stop_token_ids",
             f"stop_token_ids {bad_stop_ids} contain out-of-vocab token ids. "
             f"Vocabulary size: {card.vocab_size}")
    bad_bias = [t for t in o.logit_bias if not 0 <= t < card.vocab_size]
    _require(not bad_bias, "logit_bias",
             f"token_id(s) {bad_bias} in logit_bias contain out-of-vocab token ids. "
             f"Vocabulary size: {card.vocab_size}")


def _check_logprobs(value: int | None, field: str, what: str, card: ModelCard,
                    max_logprobs: int) -> None:
    if value is None:
        return
    _require(value >= -1, field, f"{field} must be non-negative or -1, got {value}.")
    # -1 asks for the whole vocabulary, which vLLM refers to --max-logprobs like any number.
    wanted = card.vocab_size if value == -1 else value
    _require(wanted <= max_logprobs, field,
             f"Requested {what} logprobs of {wanted}, which is greater than max allowed: "
             f"{max_logprobs} ({field}).")


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(message, param=field)


def check_prompt(token_ids: Sequence[int], card: ModelCard) -> None:
    """vLLM's input-processor checks: not empty, in vocabulary, room for one output token."""
    _require(len(token_ids) > 0, "input", "The decoder prompt cannot be empty (input).")
    top = max(token_ids)
    _require(top < card.vocab_size, "input", f"Token id {top} is out of vocabulary (input).")
    limit = max_prompt_len(card)
    _require(len(token_ids) <= limit, "input",
             f"The decoder prompt (length {len(token_ids)}) is longer than the maximum model "
             f"length of {limit}. Make sure that `max_model_len` is no smaller than the number "
             f"of text tokens (input).")


def max_prompt_len(card: ModelCard) -> int:
    # One position stays free for the first output token.
    return max(card.max_model_len - 1, 1)


def truncate_prompt(token_ids: list[int], params: pb.SamplingParams, card: ModelCard) -> list[int]:
    """`truncate_prompt_tokens`: keep the last k tokens (-1: the model's limit)."""
    if not params.HasField("truncate_prompt_tokens"):
        return token_ids
    k = params.truncate_prompt_tokens
    _require(k == -1 or k >= 1, "truncate_prompt_tokens",
             f"truncate_prompt_tokens must be an integer >= 1 or -1, got {k}.")
    keep = max_prompt_len(card) if k == -1 else k
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


def check_kv_transfer(request: pb.GenerateRequest) -> None:
    """vLLM rejects typed kv_transfer_params without a remote host and port."""
    if request.HasField("kv_transfer_params"):
        params = request.kv_transfer_params
        _require(bool(params.remote_host) and params.remote_port != 0, "kv_transfer_params",
                 "Invalid kv_transfer_params: remote_host and remote_port must be set.")
    if request.HasField("kv_transfer_params_json"):
        try:
            parsed = json.loads(request.kv_transfer_params_json)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise InvalidRequest(f"Invalid kv_transfer_params_json: {exc}",
                                 param="kv_transfer_params_json") from exc
        _require(isinstance(parsed, dict), "kv_transfer_params_json",
                 "Invalid kv_transfer_params_json: must be a JSON object.")


# ---- responses ------------------------------------------------------------------------------

def output_logprobs(items: Sequence[TokenLogprob] | None, num_top: int | None
                    ) -> pb.OutputLogProbs | None:
    """vLLM's OutputLogProbs: one entry per token; top alternatives only when num_top > 0."""
    return logprobs.output_logprobs(pb.OutputLogProbs, items, num_top)


def input_logprobs(items: Sequence[TokenLogprob | None] | None, prompt_ids: Sequence[int],
                   num_top: int | None) -> pb.InputLogProbs | None:
    """vLLM's InputLogProbs: every prompt position, the first one without a value."""
    return logprobs.input_logprobs(pb.InputLogProbs, items, prompt_ids, num_top)


def complete_message(index: int, token_ids: list[int], finish_reason: str | None,
                     matched_stop: int | str | None, prompt_tokens: int, cached_tokens: int,
                     out_lp: pb.OutputLogProbs | None, in_lp: pb.InputLogProbs | None
                     ) -> pb.GenerateResponse:
    complete = pb.GenerateComplete(
        output_ids=token_ids,
        finish_reason=finish_reason or "stop",
        prompt_tokens=prompt_tokens,
        completion_tokens=len(token_ids),
        cached_tokens=cached_tokens,
        output_logprobs=out_lp,
        input_logprobs=in_lp,
        index=index,
    )
    if isinstance(matched_stop, str):
        complete.matched_stop_str = matched_stop
    elif isinstance(matched_stop, int):
        complete.matched_token_id = matched_stop
    return pb.GenerateResponse(complete=complete)


class ResponseBuilder:
    """Turns one request's `GenerationUpdate`s into `GenerateResponse`s.

    stream=True: a DELTA chunk per sequence delta, and a `complete` carrying the last delta
    when a sequence finishes (vLLM's servicer does exactly this; clients accumulate chunks).
    stream=False: deltas accumulate here; a `complete` per index, in index order, at the end.
    """

    def __init__(self, prompt_ids: Sequence[int], sampling: SamplingOptions, stream: bool):
        self.prompt_ids = prompt_ids
        self.stream = stream
        self.num_logprobs = sampling.logprobs
        self.num_prompt_logprobs = sampling.prompt_logprobs
        self.completion_tokens = 0
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        self._prompt_lp: list[TokenLogprob | None] | None = None
        self._seen: set[int] = set()
        self._tokens: dict[int, list[int]] = {}
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        self._final: dict[int, SequenceDelta] = {}

    def feed(self, update: GenerationUpdate) -> list[pb.GenerateResponse]:
        self.prompt_tokens = update.prompt_tokens
        self.cached_tokens = update.cached_tokens
        if update.prompt_logprobs is not None:
            self._prompt_lp = update.prompt_logprobs
        if self.stream:
            return self._stream(update)
        for seq in update.sequences:
            self.completion_tokens += len(seq.token_ids)
            self._tokens.setdefault(seq.index, []).extend(seq.token_ids)
            if seq.logprobs:
                self._logprobs.setdefault(seq.index, []).extend(seq.logprobs)
            if seq.finish_reason is not None:
                self._final[seq.index] = seq
        return self._finish_all() if update.finished else []

    def _stream(self, update: GenerationUpdate) -> list[pb.GenerateResponse]:
        out: list[pb.GenerateResponse] = []
        for seq in update.sequences:
            self.completion_tokens += len(seq.token_ids)
            in_lp = None
            if seq.index not in self._seen:
                self._seen.add(seq.index)
                in_lp = self._input_lp(update.prompt_logprobs)
            out_lp = (output_logprobs(seq.logprobs, self.num_logprobs)
                      if seq.logprobs else None)
            out.append(pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
                token_ids=seq.token_ids,
                prompt_tokens=update.prompt_tokens,
                completion_tokens=len(seq.token_ids),
                cached_tokens=update.cached_tokens,
                output_logprobs=out_lp,
                input_logprobs=in_lp,
                index=seq.index,
            )))
            if seq.finish_reason is not None:
                out.append(complete_message(
                    seq.index, seq.token_ids, seq.finish_reason, seq.matched_stop,
                    update.prompt_tokens, update.cached_tokens, out_lp,
                    self._input_lp(update.prompt_logprobs)))
        return out

    def _finish_all(self) -> list[pb.GenerateResponse]:
        in_lp = self._input_lp(self._prompt_lp)
        out = []
        for index in sorted(self._tokens.keys() | self._final.keys()):
            final = self._final.get(index)
            out.append(complete_message(
                index, self._tokens.get(index, []),
                final.finish_reason if final else "abort",
                final.matched_stop if final else None,
                self.prompt_tokens, self.cached_tokens,
                output_logprobs(self._logprobs.get(index), self.num_logprobs), in_lp))
        return out

    def _input_lp(self, items: list[TokenLogprob | None] | None) -> pb.InputLogProbs | None:
        if items is None or self.num_prompt_logprobs is None:
            return None
        return input_logprobs(items, self.prompt_ids, self.num_prompt_logprobs)

    def usage_trailer(self) -> str:
        return (f"prompt_tokens={self.prompt_tokens};completion_tokens={self.completion_tokens};"
                f"cached_tokens={self.cached_tokens}")
