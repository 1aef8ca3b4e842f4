"""Tokenize long texts off the event loop.

`TokenizerBundle.encode` holds the GIL for its whole run (~3 us per token for Qwen3: 13 ms for
a 4k-token prompt), so on an asyncio loop it stalls every other request meanwhile. The
`tokenizers` batch call releases the GIL: run in a worker thread, it lets the loop go on (and
use another core). Short texts stay inline, where the hop to a thread and back would cost
more than it frees.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from kvswitch.tokenization.bundle import TokenizerBundle

__all__ = ["OFFLOAD_TEXT_CHARS", "encode_off_loop", "needs_offload"]

OFFLOAD_TEXT_CHARS = 2048
"""Texts this long (~350 tokens, ~1 ms of tokenizing) or longer go to a worker thread."""
_THREADS = 2

_executor: ThreadPoolExecutor | None = None


def needs_offload(text: str) -> bool:
    return len(text) >= OFFLOAD_TEXT_CHARS


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:  # made on first use: most processes never need it
        _executor = ThreadPoolExecutor(_THREADS, thread_name_prefix="kvswitch-tokenize")
    return _executor


async def encode_off_loop(tokenizer: TokenizerBundle, text: str, *,
                          add_special_tokens: bool = False) -> list[int]:
    """`tokenizer.encode(text)`, in a worker thread when the text is long."""
    if not needs_offload(text):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    encode = functools.partial(tokenizer.encode_nogil, text, add_special_tokens=add_special_tokens)
    return await asyncio.get_running_loop().run_in_executor(_pool(), encode)
