"""An incomplete unit of a byte stream (an HTTP/2 frame, a gRPC message), kept across reads.

`Pieces` holds the bytes received so far as they came and joins them once, when the unit is
whole: a big unit arrives in many reads, and joining at every read would copy it again each
time. Used by `kvswitch.protocol.http2.FrameReader` and `kvswitch.protocol.grpc_framing
.FrameDecoder`, which cut units out of the joined bytes and keep what is left over.
"""

from __future__ import annotations

__all__ = ["Pieces"]


class Pieces:
    """`have` bytes kept in `parts`; `need` bytes complete the unit."""

    __slots__ = ("have", "need", "parts")

    def __init__(self, need: int = 0) -> None:
        self.parts: list[bytes] = []
        self.have = 0
        self.need = need

    def add(self, data: bytes) -> bytes | None:
        """`data` after what is kept: all of it joined once `need` bytes are there (nothing is
        kept then), else None."""
        self.parts.append(data)
        self.have += len(data)
        if self.have < self.need:
            return None
        joined = b"".join(self.parts)
        self.parts, self.have = [], 0
        return joined

    def keep(self, rest: bytes, need: int) -> None:
        """Keep `rest`, the start of a unit that `need` bytes complete."""
        self.parts, self.have, self.need = [rest], len(rest), need
