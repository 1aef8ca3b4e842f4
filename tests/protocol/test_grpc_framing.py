"""The gRPC length-prefixed message codec."""

from __future__ import annotations

import gzip
import zlib

import pytest

from kvswitch.errors import InvalidRequest, PayloadTooLarge
from kvswitch.protocol.grpc_framing import FrameDecoder, decode_all, encode, single_message


def test_encode_writes_flag_and_big_endian_length() -> None:
    assert encode(b"abc") == b"\x00\x00\x00\x00\x03abc"
    assert encode(b"", compressed=True) == b"\x01\x00\x00\x00\x00"


def test_decode_all_returns_every_message() -> None:
    body = encode(b"one") + encode(b"") + encode(b"three")
    assert decode_all(body) == [b"one", b"", b"three"]


def test_incremental_decoder_yields_messages_as_they_complete() -> None:
    body = encode(b"hello") + encode(b"world!")
    decoder = FrameDecoder()
    got: list[bytes] = []
    for i in range(len(body)):  # one byte at a time: the worst split
        got += decoder.feed(body[i : i + 1])
    assert got == [b"hello", b"world!"]
    assert decoder.pending == 0
    decoder.close()


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [("gzip", gzip.compress), ("deflate", zlib.compress)],
)
def test_compressed_messages_are_inflated(encoding: str, compress: object) -> None:
    payload = b"x" * 10_000
    body = encode(compress(payload), compressed=True) + encode(b"plain")  # type: ignore[operator]
    assert decode_all(body, encoding=encoding) == [payload, b"plain"]


def test_compressed_flag_without_encoding_is_invalid() -> None:
    with pytest.raises(InvalidRequest, match="compressed but grpc-encoding is 'absent'"):
        decode_all(encode(gzip.compress(b"x"), compressed=True))


def test_unknown_encoding_is_invalid() -> None:
    with pytest.raises(InvalidRequest, match="unsupported grpc-encoding 'snappy'"):
        decode_all(encode(b"x"), encoding="snappy")


def test_corrupt_gzip_is_invalid() -> None:
    with pytest.raises(InvalidRequest, match="corrupt gzip"):
        decode_all(encode(b"not gzip at all", compressed=True), encoding="gzip")


def test_bad_flag_is_invalid() -> None:
    with pytest.raises(InvalidRequest, match="bad gRPC frame flag 0x02"):
        decode_all(b"\x02\x00\x00\x00\x01x")


@pytest.mark.parametrize("cut", [1, 4, 5, 7])
def test_truncated_body_is_invalid(cut: int) -> None:
    body = encode(b"abc") + encode(b"defgh")[:cut]
    with pytest.raises(InvalidRequest, match="truncated gRPC message"):
        decode_all(body)
    decoder = FrameDecoder()
    assert decoder.feed(body) == [b"abc"]
    with pytest.raises(InvalidRequest, match="truncated"):
        decoder.close()


def test_declared_length_over_the_limit_is_too_large_before_buffering() -> None:
    # Only the prefix has arrived: the limit applies to the declared length.
    with pytest.raises(PayloadTooLarge, match="exceeds the 100-byte limit"):
        FrameDecoder(max_message_bytes=100).feed(b"\x00\x00\x00\x01\x00")


def test_decompression_bomb_is_too_large() -> None:
    bomb = gzip.compress(b"\0" * 1_000_000)
    assert len(bomb) < 2_000
    with pytest.raises(PayloadTooLarge, match="decompressed"):
        decode_all(encode(bomb, compressed=True), encoding="gzip", max_message_bytes=10_000)


def test_single_message_takes_exactly_one_plain_message_within_the_limit() -> None:
    assert single_message(encode(b"abc")) == b"abc"
    assert single_message(encode(b"")) == b""
    assert single_message(encode(b"abc") + encode(b"d")) is None  # two: decode_all's case
    assert single_message(encode(b"abc")[:-1]) is None  # truncated
    assert single_message(encode(b"abc", compressed=True)) is None
    assert single_message(encode(b"abcd"), max_message_bytes=3) is None
    assert single_message(b"\0\0") is None
