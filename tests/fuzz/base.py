"""What the fuzz targets share: the `Target` record (both engines use it: hypothesis draws
`inputs`, atheris's bytes go through `codec`, and both hand the input to `check`), the mutator
that turns well-formed inputs into broken ones, and a transport that records what a protocol
writes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from tests.fuzz.raw import BYTES, Codec

__all__ = ["FakeTransport", "Target", "mutated"]


@dataclass(frozen=True)
class Target:
    name: str
    inputs: st.SearchStrategy[Any]
    check: Callable[[Any], None]
    codec: Codec = BYTES


def mutated(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Valid bytes cut short, with bytes flipped, or with junk spliced in."""

    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        data = bytearray(draw(valid))
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from(["cut", "flip", "splice"]))
            at = draw(st.integers(0, len(data)))
            if kind == "cut":
                del data[at:]
            elif kind == "flip" and at < len(data):
                data[at] ^= draw(st.integers(1, 255))
            else:
                data[at:at] = draw(st.binary(max_size=16))
        return bytes(data)

    return st.one_of(valid, mutate(), st.binary(max_size=256))


class FakeTransport:
    """Collects what a protocol writes; stands in for an asyncio transport."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed
