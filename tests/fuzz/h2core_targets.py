"""Fuzz targets for the shared HTTP/2 frame layer (`kvswitch.protocol.http2`): `h2-frames` feeds
`FrameReader` frames that are well-formed, cut or mutated, whole and cut at two points, and
checks that where the bytes are cut changes nothing (the same frames, then the same error),
that what comes out keeps RFC 9113's rules, and that nothing but `H2ProtocolError` is raised;
`hpack-blocks` does the same for `HeaderDecoder` with encoded and mutated header blocks."""

from __future__ import annotations

from hpack import Encoder
from hypothesis import strategies as st

from kvswitch.protocol.http2 import (
    DATA,
    END_HEADERS,
    HEADERS,
    PING,
    PREFACE,
    PRIORITY,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    FrameReader,
    H2ProtocolError,
    HeaderDecoder,
    frame,
)
from tests.fuzz.base import Target, mutated
from tests.fuzz.raw import CHUNKS, Codec

__all__ = ["H2_FRAMES", "HPACK_BLOCKS"]

_MAX_BLOCK = 64
_FIXED = {PING: 8, WINDOW_UPDATE: 4, RST_STREAM: 4, PRIORITY: 5}

_frame = st.builds(
    frame, st.integers(0, 11), st.sampled_from([0, 1, 4, 5, 8, 0x20, 0x2C, 0x2D, 255]),
    st.sampled_from([0, 1, 3, 2**31 - 1, 2**31 + 1]), st.binary(max_size=48))
_h2_input = st.lists(st.one_of(_frame, mutated(_frame)), max_size=10).map(b"".join)


def _read(pieces: list[bytes]) -> tuple[list[tuple[int, int, int, bytes, int]], int | None]:
    """The frames handed over and the error code (None: no error) for `pieces` in turn."""
    got: list[tuple[int, int, int, bytes, int]] = []
    reader = FrameReader(lambda f, s, p, n: got.append((DATA, f, s, p, n)),
                         lambda k, f, s, p, n: got.append((k, f, s, p, n)),
                         max_header_block=_MAX_BLOCK, max_frame=16384, preface=True)
    try:
        for piece in pieces:
            reader.feed(piece)
    except H2ProtocolError as exc:
        return got, exc.code
    return got, None


def check_h2_frames(args: tuple[bytes, int, int]) -> None:
    data, first, second = args
    stream = PREFACE + frame(SETTINGS, 0, 0) + data
    first, second = sorted((min(first, len(stream)), min(second, len(stream))))
    whole = _read([stream])
    assert _read([stream[:first], stream[first:second], stream[second:]]) == whole
    for kind, flags, stream_id, payload, length in whole[0]:
        assert len(payload) <= length <= 16384
        if kind in (DATA, HEADERS):
            assert stream_id
        if kind == HEADERS:
            assert flags & END_HEADERS and len(payload) <= _MAX_BLOCK
        assert kind not in _FIXED or length == _FIXED[kind]


H2_FRAMES = Target("h2-frames", st.tuples(_h2_input, st.integers(0, 200), st.integers(0, 200)),
                   check_h2_frames, Codec("bytes", (255, 255)))

_fields = st.lists(st.tuples(st.sampled_from([":status", "grpc-status", "x-a", "x-b"]),
                             st.text(max_size=20)), max_size=6)
_block = st.tuples(_fields, st.booleans()).map(
    lambda a: bytes(Encoder().encode(a[0], huffman=a[1])))


def check_hpack_blocks(blocks: list[bytes]) -> None:
    decoder = HeaderDecoder(256)
    for block in blocks:
        try:
            headers = decoder.decode(block)
        except H2ProtocolError:
            return  # a connection error: the table is out of step from here on
        assert sum(32 + len(k) + len(v) for k, v in headers.items()) <= 256  # the cap holds


HPACK_BLOCKS = Target("hpack-blocks", st.lists(mutated(_block), max_size=4), check_hpack_blocks,
                      CHUNKS)
