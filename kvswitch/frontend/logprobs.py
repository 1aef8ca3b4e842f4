"""OpenAI's `logprobs` fields built from the engine's `TokenLogprobs`, for chat and completions.

A token's text is its bytes (the model's decode table, else the tokenizer's decode of the one
id) read as UTF-8, invalid sequences replaced, so a token that splits a character still shows.
Chat gives `{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`; legacy
completions give parallel lists `tokens`, `token_logprobs`, `text_offset` (where each token's
text starts in the choice's text) and `top_logprobs` (token text -> logprob, or None).
"""

from __future__ import annotations

from typing import Any

from kvswitch.frontend.generation import TokenLogprobs
from kvswitch.frontend.serving_models import ServedModel

__all__ = ["chat_logprobs", "completion_logprobs", "token_bytes", "token_text"]


def token_bytes(model: ServedModel, token_id: int) -> bytes:
    table = model.decode_table
    if table is not None and token_id < len(table.with_special):
        return table.with_special[token_id]
    return model.tokenizer.decode([token_id]).encode("utf-8")


def token_text(model: ServedModel, token_id: int) -> str:
    return token_bytes(model, token_id).decode("utf-8", errors="replace")


def _top(lp: TokenLogprobs, i: int) -> list[tuple[int, float]]:
    """Token `i`'s alternatives (none when the engine sent fewer top lists than tokens)."""
    return lp.top[i] if i < len(lp.top) else []


def _chat_entry(model: ServedModel, token_id: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(model, token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
            "bytes": list(raw)}


def chat_logprobs(model: ServedModel, lp: TokenLogprobs) -> dict[str, Any]:
    """Chat's `choices[].logprobs`: `{"content": [...]}`."""
    content = []
    for i, (token_id, logprob) in enumerate(zip(lp.token_ids, lp.logprobs)):
        entry = _chat_entry(model, token_id, logprob)
        entry["top_logprobs"] = [_chat_entry(model, t, v) for t, v in _top(lp, i)]
        content.append(entry)
    return {"content": content}


def completion_logprobs(model: ServedModel, lp: TokenLogprobs, offset: int) -> dict[str, Any]:
    """Legacy completions' logprobs; `offset` is where this delta's text starts."""
    tokens, offsets, tops = [], [], []
    for i, token_id in enumerate(lp.token_ids):
        token = token_text(model, token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        tops.append({token_text(model, t): v for t, v in _top(lp, i)} or None)
    return {"text_offset": offsets, "token_logprobs": list(lp.logprobs), "tokens": tokens,
            "top_logprobs": tops}
