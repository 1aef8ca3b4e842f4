"""`encode_off_loop`: long texts tokenized in a worker thread (the event loop keeps turning),
with exactly the ids `encode` gives; short texts inline."""

from __future__ import annotations

import asyncio

from kvswitch.tokenization import load_tokenizer
from kvswitch.tokenization.offload import OFFLOAD_TEXT_CHARS, encode_off_loop, needs_offload

BUNDLE = load_tokenizer(None)


async def _turns_while(coro: object) -> tuple[int, list[int]]:
    task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
    turns = 0
    while not task.done():
        turns += 1
        await asyncio.sleep(0)
    return turns, await task


async def test_long_text_goes_to_a_thread_and_short_text_stays_inline() -> None:
    long_text = "Grüße aus Köln 你好世界 😀 and plain ASCII, " * 2000  # ~90k characters
    short_text = "héllo 你好 😀"
    assert needs_offload(long_text) and not needs_offload(short_text)
    assert len(short_text) < OFFLOAD_TEXT_CHARS
    turns, ids = await _turns_while(encode_off_loop(BUNDLE, long_text))
    assert turns >= 10  # inline, the task would have finished in its first step
    assert ids == BUNDLE.encode(long_text)
    turns, ids = await _turns_while(encode_off_loop(BUNDLE, short_text))
    assert turns <= 1 and ids == BUNDLE.encode(short_text)


async def test_special_tokens_are_handled_as_encode_does() -> None:
    text = "<|im_start|>user\n" + "word " * 1000 + "<|im_end|>"
    assert needs_offload(text)
    for add in (False, True):
        assert (await encode_off_loop(BUNDLE, text, add_special_tokens=add)
                == BUNDLE.encode(text, add_special_tokens=add))
