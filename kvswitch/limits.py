"""Limits on what arrives from outside: one dataclass per kind, each field a CLI flag.

- `SamplingLimits`: the counts inside one generation request (`n`, `best_of`, logprobs, stop
  strings and their length, stop token ids, logit_bias entries, max_tokens, and prompts x n:
  the engine calls one request fans out to). `check_sampling` applies them; the engine
  (`kvswitch engine`) and the EPP (`kvswitch epp`, `kvswitch up`) both do, and the frontend
  with the defaults, so an absurd request is refused before it costs anything
  (INVALID_ARGUMENT / 400, naming the field). The engine also bounds max_tokens by its
  max_model_len.
- `HttpLimits`: the frontend's HTTP/1.1 server (`kvswitch frontend`; Envoy's listener and the
  engine's /metrics server take the head limits too): request target and head bytes
  (414 / 431), header count (431), a deadline for the request head and one for the body
  (408), the keep-alive idle timeout, the body size (413).
- `MessageLimits`: one gRPC message after decompression (RESOURCE_EXHAUSTED / 413).
- `MAX_TOKENIZER_ARCHIVE_BYTES`: a tokenizer archive the frontend downloads from its target
  (GetTokenizer), compressed and each file inflated.

`add_*_flags(parser)` declares a kind's flags and `*_from_args(args)` reads them back.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvswitch.errors import InvalidRequest

__all__ = [
    "HTTP_DEFAULTS",
    "MAX_TOKENIZER_ARCHIVE_BYTES",
    "MESSAGE_DEFAULTS",
    "SAMPLING_DEFAULTS",
    "HttpLimits",
    "MessageLimits",
    "SamplingCounts",
    "SamplingLimits",
    "add_http_flags",
    "add_message_flags",
    "add_sampling_flags",
    "check_sampling",
    "http_from_args",
    "json_sampling_counts",
    "message_from_args",
    "proto_sampling_counts",
    "sampling_from_args",
]

_MiB = 1024 * 1024
MAX_TOKENIZER_ARCHIVE_BYTES = 256 * _MiB


@dataclass(frozen=True, slots=True)
class SamplingLimits:
    max_n: int = 128
    """Sequences per request (`n`, and OpenAI's `best_of`); OpenAI's own API caps n at 128."""
    max_logprobs: int = 20
    """Top logprobs per token, output and prompt (vLLM's --max-logprobs default)."""
    max_stop: int = 64
    """Stop strings, and stop token ids, per request."""
    max_stop_chars: int = 1024
    """Characters in one stop string."""
    max_logit_bias: int = 1024
    """logit_bias entries."""
    max_tokens: int = 1_048_576
    """Largest max_tokens (the engine also bounds it by its max_model_len)."""
    max_sequences: int = 2048
    """Prompts (a batched completions prompt, embeddings inputs) times `n`: each is a call."""


@dataclass(frozen=True, slots=True)
class SamplingCounts:
    """The counts of one request that `SamplingLimits` bounds (None: the field is absent)."""

    n: int | None = None
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: int = 0
    logit_bias: int = 0
    max_tokens: int | None = None
    prompts: int = 1
    prompts_field: str = "prompt"
    """The field holding the prompts (embeddings: `input`), for the error's `param`."""


def proto_sampling_counts(params: Any) -> SamplingCounts:
    """The counts of a vLLM gRPC `SamplingParams` message (logprobs excepted: the engine checks
    them in vLLM's words)."""
    return SamplingCounts(
        n=params.n, stop=tuple(params.stop), stop_token_ids=len(params.stop_token_ids),
        logit_bias=len(params.logit_bias),
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None)


def json_sampling_counts(body: Mapping[str, Any]) -> SamplingCounts:
    """The counts of an OpenAI completions / chat body; a field of the wrong type counts as
    absent (the server that validates the body refuses it)."""
    stop = body.get("stop")
    stops: Sequence[str] = (stop,) if isinstance(stop, str) else (
        [s for s in stop if isinstance(s, str)] if isinstance(stop, list) else ())
    stop_ids, bias = body.get("stop_token_ids"), body.get("logit_bias")
    logprobs = _count(body, "logprobs")
    return SamplingCounts(
        n=_count(body, "n"), best_of=_count(body, "best_of"),
        logprobs=_count(body, "top_logprobs") if logprobs is None else logprobs,
        prompt_logprobs=_count(body, "prompt_logprobs"), stop=stops,
        stop_token_ids=len(stop_ids) if isinstance(stop_ids, list) else 0,
        logit_bias=len(bias) if isinstance(bias, dict) else 0,
        max_tokens=_count(body, "max_completion_tokens") or _count(body, "max_tokens"),
        prompts=_prompts(body.get("prompt")))


def _prompts(prompt: Any) -> int:
    # A list of strings or of token lists is a batch; a string or one token list is one prompt.
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def _count(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    return value if type(value) is int else None


def check_sampling(counts: SamplingCounts, limits: SamplingLimits) -> None:
    """Raises `InvalidRequest` naming the first field over its limit."""
    for name, value in (("n", counts.n), ("best_of", counts.best_of)):
        if value is not None and value > limits.max_n:
            _over(name, value, limits.max_n, "--max-n")
    for name, value in (("logprobs", counts.logprobs),
                        ("prompt_logprobs", counts.prompt_logprobs)):
        if value is not None and value > limits.max_logprobs:
            _over(name, value, limits.max_logprobs, "--max-logprobs")
    if len(counts.stop) > limits.max_stop:
        _over("stop", len(counts.stop), limits.max_stop, "--max-stop", "stop strings")
    longest = max((len(s) for s in counts.stop), default=0)
    if longest > limits.max_stop_chars:
        _over("stop", longest, limits.max_stop_chars, "--max-stop-chars",
              "characters in a stop string")
    if counts.stop_token_ids > limits.max_stop:
        _over("stop_token_ids", counts.stop_token_ids, limits.max_stop, "--max-stop",
              "stop token ids")
    if counts.logit_bias > limits.max_logit_bias:
        _over("logit_bias", counts.logit_bias, limits.max_logit_bias, "--max-logit-bias",
              "logit_bias entries")
    if counts.max_tokens is not None and counts.max_tokens > limits.max_tokens:
        _over("max_tokens", counts.max_tokens, limits.max_tokens, "--max-tokens")
    sequences = counts.prompts * max(counts.n or 1, counts.best_of or 1)
    if sequences > limits.max_sequences:
        _over(counts.prompts_field if counts.prompts > 1 else "n", sequences, limits.max_sequences,
              "--max-sequences", "sequences (prompts x n)")


def _over(field: str, value: int, limit: int, flag: str, what: str | None = None) -> None:
    counted = f"{value} {what}" if what else str(value)
    raise InvalidRequest(f"{field}: {counted} is over this server's limit of {limit} ({flag})",
                         param=field)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_url_bytes: int = 8192
    """The request target (path and query); longer: 414."""
    max_header_bytes: int = 32768
    """The request line and headers together; more: 431."""
    max_headers: int = 100
    """Header fields; more: 431."""
    head_timeout: float = 10.0
    """Seconds from a request's first byte to the end of its headers; later: 408."""
    body_timeout: float = 60.0
    """Seconds from the end of the headers to the end of the body; later: 408."""
    idle_timeout: float = 30.0
    """Seconds a connection may sit without a request (or without any byte mid-request)."""
    max_body_bytes: int = 32 * _MiB
    """A request body; larger: 413."""


@dataclass(frozen=True, slots=True)
class MessageLimits:
    max_message_bytes: int = 16 * _MiB
    """One gRPC request message, after decompression; larger: RESOURCE_EXHAUSTED."""


SAMPLING_DEFAULTS = SamplingLimits()
HTTP_DEFAULTS = HttpLimits()
MESSAGE_DEFAULTS = MessageLimits()

_HELP = {
    "max_n": "largest n (and best_of) per request",
    "max_logprobs": "largest logprobs / prompt_logprobs (top alternatives per token)",
    "max_stop": "most stop strings, and most stop token ids, per request",
    "max_stop_chars": "longest stop string (characters)",
    "max_logit_bias": "most logit_bias entries per request",
    "max_tokens": "largest max_tokens per request",
    "max_sequences": "most sequences per request: prompts (batched) x n",
    "max_url_bytes": "longest request target (path + query); longer: 414",
    "max_header_bytes": "largest request line + headers in bytes; larger: 431",
    "max_headers": "most header fields per request; more: 431",
    "head_timeout": "seconds from a request's first byte to the end of its headers (then 408)",
    "body_timeout": "seconds from the end of the headers to the end of the body (then 408)",
    "idle_timeout": "seconds a keep-alive connection may idle, or a request go without a byte",
    "max_body_bytes": "largest request body in bytes (larger: 413)",
    "max_message_bytes": "largest gRPC request message after decompression, in bytes",
}


def _add_flags(parser: argparse.ArgumentParser, title: str, limits: object,
               skip: Sequence[str] = ()) -> None:
    group = parser.add_argument_group(title)
    for f in fields(limits):  # type: ignore[arg-type]
        if f.name in skip:
            continue
        default = getattr(limits, f.name)
        group.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=default,
                           metavar="N" if isinstance(default, int) else "SECONDS",
                           help=_HELP[f.name])


def _from_args(kind: type, args: argparse.Namespace) -> object:
    return kind(**{f.name: getattr(args, f.name) for f in fields(kind)
                   if getattr(args, f.name, None) is not None})


def add_sampling_flags(parser: argparse.ArgumentParser, *,
                       defaults: SamplingLimits = SAMPLING_DEFAULTS) -> None:
    _add_flags(parser, "request limits (larger: INVALID_ARGUMENT / 400)", defaults)


def sampling_from_args(args: argparse.Namespace) -> SamplingLimits:
    return _from_args(SamplingLimits, args)  # type: ignore[return-value]


def add_http_flags(parser: argparse.ArgumentParser, *, defaults: HttpLimits = HTTP_DEFAULTS,
                   skip: Sequence[str] = ()) -> None:
    _add_flags(parser, "HTTP/1.1 limits", defaults, skip)


def http_from_args(args: argparse.Namespace) -> HttpLimits:
    return _from_args(HttpLimits, args)  # type: ignore[return-value]


def add_message_flags(parser: argparse.ArgumentParser, *,
                      defaults: MessageLimits = MESSAGE_DEFAULTS) -> None:
    _add_flags(parser, "gRPC message limits", defaults)


def message_from_args(args: argparse.Namespace) -> MessageLimits:
    return _from_args(MessageLimits, args)  # type: ignore[return-value]
