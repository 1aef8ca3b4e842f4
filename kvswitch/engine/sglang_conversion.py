"""SGLang's scheduler protobuf <-> the `Engine` contract, with SGLang's semantics.

Requests: `sampling_from_sglang` reads SGLang's `SamplingParams` as SGLang's gRPC server does
and checks it with the wording of SGLang's `SamplingParams.verify`. The proto's fields are not
optional, so a zero that SGLang would refuse is read as SGLang's default instead (top_p 0 -> 1,
top_k 0 -> -1 "disabled", repetition_penalty 0 -> 1); temperature 0 is greedy, as in SGLang.

Responses (`SglangResponseBuilder`), as SGLang's servicer shapes them:
- stream=True: a chunk per sequence delta with the new token ids and *cumulative* counts
  (prompt, completion and cached tokens of that index); when a sequence finishes, its last chunk
  is followed by a `complete` built from the same output: the last delta's ids, the finish
  reason and the cumulative counts. Input logprobs ride on an index's first chunk only.
- stream=False: one `complete` per index, in index order, with all of that index's ids.
Finish reasons are "stop", "length" and "abort"; an eos token ends with `matched_token_id` set
to it (SGLang's FINISH_MATCHED_TOKEN), a stop string with `matched_stop_str`.
`max_new_tokens` 0 is a prefill-only request: no output ids, finish reason "length".
"""

from __future__ import annotations

from collections.abc import Sequence

from kvswitch.engine import logprobs
from kvswitch.engine.base import (
    GenerationUpdate,
    ModelCard,
    SamplingOptions,
    SequenceDelta,
    TokenLogprob,
)
from kvswitch.engine.conversion import MAX_LOGPROBS, max_prompt_len
from kvswitch.errors import InvalidRequest
from kvswitch.protocol.sglang import sglang_scheduler_pb2 as pb

MAX_N = 128
"""Most samples one request may ask for (`n`)."""
_CONSTRAINTS = ("regex", "json_schema", "ebnf_grammar", "structural_tag")


def prompt_from_sglang(request: pb.GenerateRequest | pb.EmbedRequest, card: ModelCard,
                       encode: object) -> list[int]:
    """The request's token ids, checked. SGLang's servicer takes tokenized input only; an empty
    `input_ids` with `original_text` is tokenized here (kvswitch's text input)."""
    if not request.HasField("tokenized"):
        raise InvalidRequest("Tokenized input must be provided", param="tokenized")
    prompt = list(request.tokenized.input_ids)
    if not prompt and request.tokenized.original_text and callable(encode):
        prompt = list(encode(request.tokenized.original_text))
    _require(len(prompt) > 0, "tokenized", "The input_ids is empty.")
    top = max(prompt)
    _require(top < card.vocab_size, "tokenized",
             f"Token id {top} in input_ids is out of the vocabulary ({card.vocab_size}).")
    limit = max_prompt_len(card)
    _require(len(prompt) <= limit, "tokenized",
             f"Input length ({len(prompt)} tokens) exceeds the maximum allowed length ({limit} "
             f"tokens). Use a shorter input or enable --allow-auto-truncate.")
    return prompt


def sampling_from_sglang(request: pb.GenerateRequest, card: ModelCard, prompt_len: int
                         ) -> tuple[SamplingOptions, bool]:
    """Convert and check; returns the options and whether the request is prefill-only
    (max_new_tokens 0, run as one token that is not reported)."""
    p = request.sampling_params
    top_k = -1 if p.top_k == 0 else p.top_k
    _require(p.temperature >= 0.0, "temperature",
             f"temperature must be non-negative, got {p.temperature}.")
    top_p = p.top_p if p.top_p != 0.0 else 1.0
    _require(0.0 < top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {top_p}.")
    _require(0.0 <= p.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {p.min_p}.")
    _require(top_k == -1 or 1 <= top_k <= card.vocab_size, "top_k",
             f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(p, name)
        _require(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}.")
    repetition = p.repetition_penalty if p.repetition_penalty != 0.0 else 1.0
    _require(0.0 < repetition <= 2.0, "repetition_penalty",
             f"repetition_penalty must be in (0, 2], got {repetition}.")
    max_new = p.max_new_tokens if p.HasField("max_new_tokens") else None
    if max_new is not None:
        _require(p.min_new_tokens <= max_new, "min_new_tokens",
                 f"min_new_tokens must be in [0, max_new_tokens({max_new})], "
                 f"got {p.min_new_tokens}.")
        total = prompt_len + max_new
        _require(total <= card.max_model_len, "max_new_tokens",
                 f"Requested token count exceeds the model's maximum context length of "
                 f"{card.max_model_len} tokens. You requested a total of {total} tokens: "
                 f"{prompt_len} tokens from the input messages and {max_new} tokens for the "
                 f"completion. Please reduce the number of tokens in the input messages or the "
                 f"completion to fit within the limit.")
    n = p.n or 1
    _require(n <= MAX_N, "n", f"n must be at most {MAX_N}, got {n}.")
    top = request.top_logprobs_num
    _require(0 <= top <= MAX_LOGPROBS, "top_logprobs_num",
             f"top_logprobs_num must be in [0, {MAX_LOGPROBS}], got {top}.")
    logprobs = top if request.return_logprob else None
    prompt_logprobs = top if request.return_logprob and request.logprob_start_len >= 0 else None
    kind = p.WhichOneof("constraint")
    options = SamplingOptions(
        max_tokens=1 if max_new == 0 else max_new,
        min_tokens=p.min_new_tokens,
        temperature=p.temperature,
        top_p=top_p,
        top_k=0 if top_k == -1 else top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=repetition,
        n=n,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.no_stop_trim,
        skip_special_tokens=p.skip_special_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=_logit_bias(p, card),
        constraint=(kind, str(getattr(p, kind))) if kind in _CONSTRAINTS else None,
    )
    _require(all(options.stop), "stop", "stop cannot contain an empty string.")
    return options, max_new == 0


def _logit_bias(p: pb.SamplingParams, card: ModelCard) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in p.logit_bias.items():
        _require(key.isdigit() and int(key) < card.vocab_size, "logit_bias",
                 f"logit_bias key {key!r} is not a token id in the vocabulary.")
        bias[int(key)] = value
    return bias


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(message, param=field)


# ---- responses ------------------------------------------------------------------------------

class SglangResponseBuilder:
    """Turns one request's `GenerationUpdate`s into SGLang `GenerateResponse`s."""

    def __init__(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingOptions,
                 stream: bool, *, eos_token_ids: Sequence[int] = (), prefill_only: bool = False,
                 logprob_start_len: int = 0):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.stream = stream
        self.num_logprobs = sampling.logprobs
        self.num_prompt_logprobs = sampling.prompt_logprobs
        self.eos = frozenset(eos_token_ids)
        self.prefill_only = prefill_only
        self.logprob_start_len = logprob_start_len
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        self._prompt_lp: list[TokenLogprob | None] | None = None
        self._counts: dict[int, int] = {}
        self._tokens: dict[int, list[int]] = {}
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        self._final: dict[int, SequenceDelta] = {}

    @property
    def completion_tokens(self) -> int:
        return sum(self._counts.values())

    def feed(self, update: GenerationUpdate) -> list[pb.GenerateResponse]:
        self.prompt_tokens = update.prompt_tokens
        self.cached_tokens = update.cached_tokens
        if update.prompt_logprobs is not None:
            self._prompt_lp = update.prompt_logprobs
        out: list[pb.GenerateResponse] = []
        for seq in update.sequences:
            ids = [] if self.prefill_only else seq.token_ids
            lps = None if self.prefill_only else seq.logprobs
            first = seq.index not in self._counts
            self._counts[seq.index] = self._counts.get(seq.index, 0) + len(ids)
            if self.stream:
                out.extend(self._stream(seq, ids, lps, first))
                continue
            self._tokens.setdefault(seq.index, []).extend(ids)
            if lps:
                self._logprobs.setdefault(seq.index, []).extend(lps)
            if seq.finish_reason is not None:
                self._final[seq.index] = seq
        if not self.stream and update.finished:
            out.extend(self._finish_all())
        return out

    def _stream(self, seq: SequenceDelta, ids: list[int], lps: list[TokenLogprob] | None,
                first: bool) -> list[pb.GenerateResponse]:
        in_lp = self._input_lp() if first else None
        out_lp = self._output_lp(lps)
        chunk = pb.GenerateStreamChunk(
            token_ids=ids, prompt_tokens=self.prompt_tokens,
            completion_tokens=self._counts[seq.index], cached_tokens=self.cached_tokens,
            output_logprobs=out_lp, input_logprobs=in_lp, index=seq.index)
        out = [pb.GenerateResponse(request_id=self.request_id, chunk=chunk)]
        if seq.finish_reason is not None:
            out.append(self._complete(seq.index, ids, seq, out_lp, in_lp))
        return out

    def _finish_all(self) -> list[pb.GenerateResponse]:
        in_lp = self._input_lp()
        return [self._complete(index, self._tokens.get(index, []), self._final.get(index),
                               self._output_lp(self._logprobs.get(index)), in_lp)
                for index in sorted(self._tokens.keys() | self._final.keys())]

    def _complete(self, index: int, ids: list[int], final: SequenceDelta | None,
                  out_lp: pb.OutputLogProbs | None, in_lp: pb.InputLogProbs | None
                  ) -> pb.GenerateResponse:
        reason = final.finish_reason if final is not None else "abort"
        matched = final.matched_stop if final is not None else None
        if self.prefill_only and reason != "abort":
            reason, matched = "length", None
        elif reason == "stop" and matched is None and final is not None and final.token_ids \
                and final.token_ids[-1] in self.eos:
            matched = final.token_ids[-1]
        complete = pb.GenerateComplete(
            output_ids=ids, finish_reason=reason or "stop", prompt_tokens=self.prompt_tokens,
            completion_tokens=self._counts.get(index, 0), cached_tokens=self.cached_tokens,
            output_logprobs=out_lp, input_logprobs=in_lp, index=index)
        if isinstance(matched, str):
            complete.matched_stop_str = matched
        elif isinstance(matched, int):
            complete.matched_token_id = matched
        return pb.GenerateResponse(request_id=self.request_id, complete=complete)

    def _output_lp(self, items: Sequence[TokenLogprob] | None) -> pb.OutputLogProbs | None:
        return logprobs.output_logprobs(pb.OutputLogProbs, items, self.num_logprobs)

    def _input_lp(self) -> pb.InputLogProbs | None:
        if self._prompt_lp is None or self.num_prompt_logprobs is None:
            return None
        return logprobs.input_logprobs(pb.InputLogProbs, self._prompt_lp, self.prompt_ids,
                                       self.num_prompt_logprobs, self.logprob_start_len)

    def usage_trailer(self) -> str:
        return (f"prompt_tokens={self.prompt_tokens};completion_tokens={self.completion_tokens};"
                f"cached_tokens={self.cached_tokens}")
