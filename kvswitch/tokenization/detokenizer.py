"""Incremental detokenization and stop-string handling for streamed token ids.

The contract: for any token sequence, the concatenation of the deltas an `IncrementalDetokenizer`
emits (including the final `flush()`) equals `tokenizer.decode(all_ids)` with the same
`skip_special_tokens`. Text is held back while it ends in an incomplete UTF-8 character, so a
client never sees a "\ufffd" that a later token would have completed.

Two strategies behind one interface:

- `ByteLevelDetokenizer` (GPT-2/Qwen/Llama-3 style byte-level BPE): every token id stands for a
  fixed byte string, so decoding is a table lookup plus Python's incremental UTF-8 decoder with
  `errors="replace"` (the same maximal-subpart replacement as Rust's `from_utf8_lossy`). No
  calls into `tokenizers` per chunk: this is the hot path of every streamed response.
- `StreamDetokenizer`, `tokenizers`' own DecodeStream, for any other decoder.
  `benchmarks/detokenizer_stream.py` measures both against DecodeStream: equally exact, and the
  table costs a third to two thirds of DecodeStream's CPU per token.

`StopStringMatcher` cuts the text at the first stop string, holding back enough characters that
a stop string split across deltas is never partly sent.
"""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Iterable, Sequence
from typing import Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

__all__ = [
    "ByteLevelDetokenizer",
    "DecodeTable",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "StreamDetokenizer",
    "new_detokenizer",
]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer(Protocol):
    def push(self, token_ids: Sequence[int]) -> str:
        """Add token ids; return the text they complete (possibly empty)."""
        ...

    def flush(self) -> str:
        """The end of the sequence: return whatever text was held back."""
        ...


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character -> byte map (the inverse of `bytes_to_unicode`)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class DecodeTable:
    """Per-id byte strings of a byte-level BPE tokenizer, with and without special tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        byte_of = _byte_decoder()
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()
        table: list[bytes] = [b""] * max(size, max(added, default=-1) + 1)
        # str.translate to latin-1 code points, then one encode: the same bytes as mapping each
        # character through `byte_of`, several times faster over a 150k vocabulary.
        to_latin1 = {ord(c): b for c, b in byte_of.items()}
        for piece, token_id in tokenizer.get_vocab(with_added_tokens=False).items():
            try:
                table[token_id] = piece.translate(to_latin1).encode("latin-1")
            except UnicodeEncodeError:  # characters outside the byte map decode to nothing
                table[token_id] = bytes(byte_of[c] for c in piece if c in byte_of)
        for token_id, added_token in added.items():
            # Added tokens decode to their literal content, outside the byte-level map.
            table[token_id] = added_token.content.encode("utf-8")
        self.with_special: tuple[bytes, ...] = tuple(table)
        for token_id, added_token in added.items():
            if added_token.special:
                table[token_id] = b""
        self.without_special: tuple[bytes, ...] = tuple(table)

    @staticmethod
    def supports(tokenizer: Tokenizer) -> bool:
        """True when the tokenizer's decoder is plain ByteLevel, so the table is exact."""
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        return decoder.get("type") == "ByteLevel"


class ByteLevelDetokenizer:
    """Table-driven exact detokenizer for byte-level BPE (see the module docstring)."""

    __slots__ = ("_decoder", "_size", "_table")

    def __init__(self, table: DecodeTable, *, skip_special_tokens: bool) -> None:
        self._table = table.without_special if skip_special_tokens else table.with_special
        self._size = len(self._table)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        table, size = self._table, self._size
        # Ids outside the vocabulary (a model's padded embedding rows) decode to nothing, as
        # in `tokenizers`.
        data = b"".join([table[i] if i < size else b"" for i in token_ids])
        text: str = self._decoder.decode(data)
        return text

    def flush(self) -> str:
        text: str = self._decoder.decode(b"", final=True)
        return text


class StreamDetokenizer:
    """`tokenizers`' DecodeStream over any `tokenizers.Tokenizer`; `flush()` sends what it holds.

    DecodeStream has no end of stream: a sequence that ends inside a character leaves text
    (a "\ufffd", as `decode` gives) in it. When the last step returned nothing, `flush()`
    decodes the whole sequence once and sends what the deltas have not."""

    # How many prompt tokens to decode the output after (leading-space rules etc.).
    _CONTEXT = 6

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool,
                 prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._context = list(prompt_ids[-self._CONTEXT:])
        self._stream = DecodeStream(ids=self._context, skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._sent = 0
        """Characters sent so far."""
        self._holding = False
        """Whether the last step returned nothing (the stream may hold text)."""

    def push(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        # One id goes in as an int: DecodeStream converts a list per call.
        ids = token_ids[0] if len(token_ids) == 1 else list(token_ids)
        delta: str | None = self._stream.step(self._tokenizer, ids)
        self._holding = delta is None
        if delta is None:
            return ""
        self._sent += len(delta)
        return delta

    def flush(self) -> str:
        if not self._holding:
            return ""
        self._holding = False
        context = self._tokenizer.decode(self._context, skip_special_tokens=self._skip)
        full: str = self._tokenizer.decode(self._context + self._ids,
                                           skip_special_tokens=self._skip)
        tail = full[len(context) + self._sent:]
        self._sent += len(tail)
        return tail


def new_detokenizer(tokenizer: Tokenizer, table: DecodeTable | None, *,
                    skip_special_tokens: bool,
                    prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
    """The fast table detokenizer when `table` is given (byte-level tokenizers), else
    DecodeStream."""
    if table is not None:
        return ByteLevelDetokenizer(table, skip_special_tokens=skip_special_tokens)
    return StreamDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens,
                             prompt_ids=prompt_ids)


class StopStringMatcher:
    """Finds the first stop string in streamed text, as vLLM's detokenizer does.

    `feed(delta)` returns the text that may be sent now; once a stop string is found it returns
    the text up to it (or through it with `include_stop_str_in_output`) and sets `matched`.
    Without `include_stop_str_in_output`, the last `max(len(stop)) - 1` characters are held back
    until `finish()`, because they might be the start of a stop string. With it, nothing is held
    back; the tail of the sent text is kept so a stop string split across deltas is still found.
    """

    __slots__ = ("_hold", "_include", "_keep", "_pending", "_stops", "_tail", "matched")

    def __init__(self, stops: Iterable[str], *, include_stop_str_in_output: bool) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop_str_in_output
        self._keep = max(max((len(s) for s in self._stops), default=0) - 1, 0)
        self._hold = 0 if include_stop_str_in_output else self._keep
        self._pending = ""
        self._tail = ""
        self.matched: str | None = None
        """The stop string that ended the text, once found."""

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, delta: str) -> str:
        if self.matched is not None:
            return ""
        text = self._pending + delta
        tail = self._tail
        cut = self._find(tail + text)
        if cut is not None:
            self._pending = ""
            return text[:max(cut - len(tail), 0)]
        if self._hold:
            split = max(len(text) - self._hold, 0)
            text, self._pending = text[:split], text[split:]
        else:
            self._pending = ""
        if self._keep:
            self._tail = (tail + text)[-self._keep:]
        return text

    def finish(self) -> str:
        """The end of the text: release what was held back."""
        text, self._pending = self._pending, ""
        return "" if self.matched is not None else text

    def cut_whole(self, text: str) -> str:
        """Apply the stop strings to a whole (non-streamed) text."""
        return self.feed(text) + self.finish()

    def _find(self, text: str) -> int | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            position = text.find(stop)
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop)
        if best is None:
            return None
        position, stop = best
        self.matched = stop
        return position + len(stop) if self._include else position
