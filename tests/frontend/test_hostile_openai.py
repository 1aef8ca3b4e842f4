"""Hostile OpenAI bodies through the real frontend and engine: token ids and counts out of the
proto's range or the vocabulary are 400 naming the field, never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.frontend.conftest import Stack

MODEL = "Qwen/Qwen3-0.6B"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"prompt": [2**32]}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [2**40]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**33]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**35}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 2**35}, "min_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_k": 2**35}, "top_k"),
    ("/v1/embeddings", {"input": [[-5]]}, "input"),
    ("/v1/embeddings", {"input": [[2**32 + 1]]}, "input"),
])
def test_out_of_range_values_are_400(stack: Stack, path: str, fields: dict[str, Any],
                                     param: str) -> None:
    body = {"model": MODEL, **({} if path == "/v1/embeddings" else {"max_tokens": 2}), **fields}
    reply = httpx.post(stack.base_url + path, json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"prompt": [[1, 2]] * 20, "n": 128, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["hi"] * 2049, "max_tokens": 1}, "prompt"),
    ("/v1/embeddings", {"input": [[1]] * 2049}, "input"),
])
def test_a_fan_out_past_the_sequence_limit_is_400(stack: Stack, path: str,
                                                  fields: dict[str, Any], param: str) -> None:
    # A small body asking for thousands of engine calls is refused before any is made.
    reply = httpx.post(stack.base_url + path, json={"model": MODEL, **fields}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "--max-sequences" in error["message"]
