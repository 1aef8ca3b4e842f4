"""How a coverage-guided fuzzer's flat bytes become a target's input, and back.

A `Codec` reads one byte per head field (a choice from a list, or an integer 0..255), then
the rest as the tail: bytes, text (UTF-8, bad bytes replaced) or chunks (a list of bytes,
split at `SEP`). The input is the tail alone when there is no head, else the tuple
(tail, *heads): the shape the hypothesis strategies draw. `encode` is the inverse, for seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BYTES", "CHUNKS", "SEP", "TEXT", "Codec"]

SEP = b"\x00--\x00"


@dataclass(frozen=True)
class Codec:
    tail: str = "bytes"
    """"bytes", "text" or "chunks"."""
    head: tuple[Sequence[Any] | int, ...] = ()
    """Per field: the choices, or an int (a byte's value, which must be at most 255)."""

    def decode(self, data: bytes) -> Any:
        values: list[Any] = []
        for i, field in enumerate(self.head):
            byte = data[i] if i < len(data) else 0
            values.append(field[byte % len(field)] if isinstance(field, Sequence) else byte)
        rest = data[len(self.head):]
        tail: Any = (rest.decode("utf-8", "replace") if self.tail == "text"
                     else rest.split(SEP) if self.tail == "chunks" and rest
                     else [] if self.tail == "chunks" else rest)
        return (tail, *values) if self.head else tail

    def encode(self, value: Any) -> bytes:
        tail, values = (value[0], value[1:]) if self.head else (value, ())
        head = bytes(field.index(v) if isinstance(field, Sequence) else v & 0xFF
                     for field, v in zip(self.head, values, strict=True))
        body = (tail.encode() if self.tail == "text"
                else SEP.join(tail) if self.tail == "chunks" else tail)
        return head + body


BYTES, TEXT, CHUNKS = Codec("bytes"), Codec("text"), Codec("chunks")
