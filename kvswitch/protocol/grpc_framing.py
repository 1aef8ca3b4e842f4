"""gRPC length-prefixed messages and call status, sans-IO; one implementation for every transport.

A gRPC message on the wire is a 5-byte prefix -- one flag byte (0 plain, 1 compressed with the
call's `grpc-encoding`) and a big-endian uint32 length -- followed by that many bytes.
`FrameDecoder` cuts messages out of a stream's bytes as they arrive (a prefix is checked as soon
as it is whole, before the message's bytes are kept), `decode_all` out of a whole body.

Errors are kvswitch errors so callers can render them: a message over the size limit (before or
after decompression) is `PayloadTooLarge`; a bad flag byte, a compressed message without an
encoding, an unknown encoding, corrupt compressed data or a body that ends mid-message is
`InvalidRequest`. A call's status travels in trailers: `trailers_block()` writes them (HPACK
literals, `grpc-message` percent-encoded), `call_status()` reads them (or, without
`grpc-status`, maps the HTTP `:status` as gRPC's doc/http-grpc-status-mapping.md says).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from urllib.parse import quote, unquote

from kvswitch.errors import InvalidRequest, PayloadTooLarge
from kvswitch.protocol.http2 import hpack_literal
from kvswitch.protocol.pieces import Pieces

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "PREFIX_SIZE",
    "SUPPORTED_ENCODINGS",
    "FrameDecoder",
    "call_status",
    "decode_all",
    "encode",
    "single_message",
    "trailers_block",
]

PREFIX_SIZE = 5
# gRPC's default max receive message size.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
SUPPORTED_ENCODINGS = ("identity", "gzip", "deflate")
# gRPC status codes kvswitch's transports produce.
OK, CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, NOT_FOUND = 0, 1, 2, 4, 5
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 8, 12, 13, 14

_PREFIX = struct.Struct(">BI")


def encode(message: bytes, *, compressed: bool = False) -> bytes:
    """Frame one message. `compressed` only sets the flag: compress `message` beforehand."""
    return _PREFIX.pack(1 if compressed else 0, len(message)) + message


def _compress_flag_error(encoding: str | None) -> InvalidRequest:
    return InvalidRequest(
        f"gRPC message is flagged compressed but grpc-encoding is {encoding or 'absent'!r}"
    )


def _decompress(payload: bytes, encoding: str | None, max_message_bytes: int) -> bytes:
    if encoding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == "deflate":
        wbits = zlib.MAX_WBITS
    else:
        raise _compress_flag_error(encoding)
    inflater = zlib.decompressobj(wbits)
    try:
        # Cap the output so a small bomb cannot inflate past the limit.
        out = inflater.decompress(payload, max_message_bytes + 1)
    except zlib.error as exc:
        raise InvalidRequest(f"corrupt {encoding} gRPC message: {exc}") from exc
    if len(out) > max_message_bytes:
        raise PayloadTooLarge(
            f"decompressed gRPC message exceeds the {max_message_bytes}-byte limit"
        )
    if not inflater.eof:
        raise InvalidRequest(f"truncated {encoding} gRPC message")
    return out


def _check_encoding(encoding: str | None) -> str | None:
    if encoding in (None, "", "identity"):
        return None
    if encoding not in SUPPORTED_ENCODINGS:
        raise InvalidRequest(f"unsupported grpc-encoding {encoding!r}")
    return encoding


class FrameDecoder:
    """Incremental decoder: `feed(bytes) -> [message, ...]`, then `close()` at end of stream;
    a partial message is kept as `Pieces`."""

    __slots__ = ("_encoding", "_max", "_partial")

    def __init__(
        self, *, encoding: str | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        self._encoding = _check_encoding(encoding)
        self._max = max_message_bytes
        self._partial = Pieces()  # an incomplete message (or prefix)

    @property
    def pending(self) -> int:
        """Bytes held that do not yet make a complete message."""
        return self._partial.have

    def feed(self, data: bytes) -> list[bytes]:
        messages: list[bytes] = []
        self.feed_into(data, messages)
        return messages

    def feed_into(self, data: bytes, messages: list[bytes]) -> None:
        """`feed()` appending to `messages`; those before a bad one are there when it raises."""
        partial = self._partial
        buffer = partial.add(data) if partial.have else data
        if buffer is None:
            return
        offset = _decode(buffer, self._encoding, self._max, messages)
        rest = len(buffer) - offset
        if rest:
            partial.keep(buffer[offset:], PREFIX_SIZE + _PREFIX.unpack_from(buffer, offset)[1]
                         if rest >= PREFIX_SIZE else PREFIX_SIZE)

    def close(self) -> None:
        """The stream ended: anything still buffered is a truncated message."""
        if self._partial.have:
            raise _truncated(self._partial.have)


def decode_all(
    data: bytes, *, encoding: str | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_messages: int | None = None,
) -> list[bytes]:
    """Decode a complete body (every message in it); a trailing partial message is an error,
    and so is a body of more than `max_messages` messages (found without decoding the rest)."""
    messages: list[bytes] = []
    consumed = _decode(data, _check_encoding(encoding), max_message_bytes, messages,
                       max_messages)
    if consumed != len(data):
        raise _truncated(len(data) - consumed)
    return messages


def single_message(data: bytes, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes | None:
    """The message if `data` is exactly one uncompressed message within the limit, else None
    (then `decode_all` says what the body holds or what is wrong with it). The usual unary
    body, read without `decode_all`'s general loop (≈ 1 us less per request)."""
    if len(data) < PREFIX_SIZE or data[0]:
        return None
    length = len(data) - PREFIX_SIZE
    if _PREFIX.unpack_from(data)[1] != length or length > max_message_bytes:
        return None
    return data[PREFIX_SIZE:]


def _truncated(leftover: int) -> InvalidRequest:
    return InvalidRequest(f"truncated gRPC message: body ends {leftover} bytes into a frame")


def _decode(data: bytes, encoding: str | None, max_message_bytes: int, messages: list[bytes],
            max_messages: int | None = None) -> int:
    """Append the complete messages at the start of `data` to `messages`; returns how many bytes
    they used. The prefix of the next, incomplete message is checked too."""
    offset = 0
    end = len(data)
    unpack, append = _PREFIX.unpack_from, messages.append
    left = -1 if max_messages is None else max_messages  # messages still allowed (-1: any)
    while end - offset >= 5:
        if not left:
            raise InvalidRequest(f"the body holds more than {max_messages} gRPC message(s)")
        left -= 1
        flag, length = unpack(data, offset)
        if flag:
            if flag > 1:
                raise InvalidRequest(f"bad gRPC frame flag {flag:#04x} (expected 0 or 1)")
            if encoding is None:
                raise _compress_flag_error(encoding)
        if length > max_message_bytes:
            raise PayloadTooLarge(
                f"gRPC message of {length} bytes exceeds the {max_message_bytes}-byte limit"
            )
        start = offset + 5
        if end - start < length:
            break
        offset = start + length
        if flag:
            append(_decompress(data[start:offset], encoding, max_message_bytes))
        else:
            append(data[start:offset])
    return offset


_MESSAGE_SAFE = " !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"  # printable ASCII but '%' stays as is
_OK_TRAILERS = hpack_literal("grpc-status", "0")


def trailers_block(status: int, message: str = "") -> bytes:
    """A call's trailers as an HPACK block (literals): `grpc-status`, and `grpc-message`
    percent-encoded as gRPC requires when there is one."""
    if status == OK and not message:
        return _OK_TRAILERS
    block = hpack_literal("grpc-status", str(status))
    if message:
        block += hpack_literal("grpc-message", quote(message, safe=_MESSAGE_SAFE))
    return block


_HTTP_TO_GRPC = {"400": INTERNAL, "401": 16, "403": 7, "404": UNIMPLEMENTED, "429": UNAVAILABLE,
                 "502": UNAVAILABLE, "503": UNAVAILABLE, "504": UNAVAILABLE}


def http_status_code(status: str) -> int:
    """The gRPC status of a response with HTTP `status` other than 200 and no `grpc-status`."""
    return _HTTP_TO_GRPC.get(status, UNKNOWN)


def call_status(fields: Mapping[str, str]) -> tuple[int, str]:
    """(gRPC status, details) from a call's trailers (or trailers-only response); a missing or
    non-numeric `grpc-status` is an error of its own."""
    code = fields.get("grpc-status")
    if code is None:
        status = fields.get(":status", "200")
        if status != "200":
            return http_status_code(status), f"missing grpc-status (HTTP status {status})"
        return INTERNAL, "missing grpc-status"
    if code == "0":
        return OK, ""
    details = fields.get("grpc-message", "")
    if "%" in details:
        details = unquote(details)
    if not code.isdigit():
        return UNKNOWN, f"grpc-status {code[:32]!r}: {details}"
    return int(code), details
