"""Token ids kept in protobuf's packed wire form: read without building a Python int per token.

A `repeated uint32` field (a prompt's `TokenizedInput.input_ids`, a KV block's
`KvBlock.token_ids`) is sent packed: one length-delimited field whose payload is the ids as
varints. On the wire that is exactly what a `bytes` field with the same number looks like. So
the EPP reads these messages through *views*: copies of the real schemas in a private package
in which those two fields are declared `bytes`. upb then hands over each field's payload as one
bytes object instead of an int per token (a third of the conversion cost per stored block),
and the precise prefix index hashes those bytes
(`kvswitch.epp.kvindex.hashing.chained_block_hashes`). Both sides are the same varints of the same
ids, so a prompt's blocks and an engine's stored blocks hash alike (encoders write each varint in
its shortest form; a client that pads them is still served, it only gets no prefix matches).

A view checks no varint inside the payload, so the request parser parses with the real schema
first (upb's checks, without reading the ids into Python), then through the view. The views are
exact for what every proto3 encoder sends (packed is proto3's default). A sender that writes
the ids unpacked (one varint field per id: legal, but only proto2-era or hand-written encoders
do) shows up in a view as an empty payload: the request parser then takes the real message's
ids, and the KV index leaves such a block unplaced.

`PackedTokenIds` is a `Sequence[int]` over such a payload: its length counts the varints, and
the ids are decoded (by upb, once) only when someone indexes or iterates it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FileDescriptor

from kvswitch.protocol import common_pb2, vllm_engine_pb2
from kvswitch.protocol.sglang import sglang_scheduler_pb2

__all__ = [
    "EmbedRequestView", "GenerateRequestView", "KvEventBatchView", "PackedTokenIds",
    "SglangEmbedRequestView", "SglangGenerateRequestView",
    "count_token_ids", "pack_token_ids", "unpack_token_ids",
]

_VIEW_PACKAGE = "kvswitch.view"
_BYTES = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
_OPTIONAL = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL


def _view_classes(file: FileDescriptor, as_bytes: set[tuple[str, str]]) -> Any:
    """Register a copy of `file` in its own package, with the (message, field) pairs of
    `as_bytes` declared `bytes`; returns a lookup of its message classes by name."""
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    own_prefix = f".{proto.package}."
    package = f"{_VIEW_PACKAGE}.{proto.package}"
    proto.name = f"kvswitch/view/{proto.name}"
    proto.package = package
    proto.ClearField("service")  # methods name the real messages; a view has no use for them
    missing = set(as_bytes)

    def rewrite(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
        for message in messages:
            for field in message.field:
                if field.type_name.startswith(own_prefix):  # this file's types: the copies
                    field.type_name = f".{package}.{field.type_name[len(own_prefix):]}"
                if (message.name, field.name) in as_bytes:
                    field.type, field.label = _BYTES, _OPTIONAL
                    field.ClearField("options")  # (packed=...)
                    missing.discard((message.name, field.name))
            rewrite(message.nested_type)

    rewrite(proto.message_type)
    if missing:
        raise LookupError(f"{file.name} has no fields {sorted(missing)}")
    pool = descriptor_pool.Default()
    pool.Add(proto)
    return lambda name: message_factory.GetMessageClass(
        pool.FindMessageTypeByName(f"{package}.{name}"))


_engine_view = _view_classes(vllm_engine_pb2.DESCRIPTOR, {("TokenizedInput", "input_ids")})
GenerateRequestView = _engine_view("GenerateRequest")
EmbedRequestView = _engine_view("EmbedRequest")
_TokenizedInputView = _engine_view("TokenizedInput")
_sglang_view = _view_classes(sglang_scheduler_pb2.DESCRIPTOR, {("TokenizedInput", "input_ids")})
SglangGenerateRequestView = _sglang_view("GenerateRequest")
SglangEmbedRequestView = _sglang_view("EmbedRequest")
KvEventBatchView = _view_classes(common_pb2.DESCRIPTOR, {("KvBlock", "token_ids")})(
    "KvEventBatch")

# A varint ends at its first byte below 0x80: deleting the others leaves one byte per id.
_CONTINUATION_BYTES = bytes(range(0x80, 0x100))


def pack_token_ids(token_ids: Iterable[int]) -> bytes:
    """The packed payload of these ids (upb encodes them; no per-id Python work)."""
    wire = vllm_engine_pb2.TokenizedInput(input_ids=token_ids).SerializeToString()
    return bytes(_TokenizedInputView.FromString(wire).input_ids)


def unpack_token_ids(packed: bytes) -> tuple[int, ...]:
    wire = _TokenizedInputView(input_ids=packed).SerializeToString()
    return tuple(vllm_engine_pb2.TokenizedInput.FromString(wire).input_ids[:])


def count_token_ids(packed: bytes) -> int:
    return len(packed.translate(None, _CONTINUATION_BYTES))


class PackedTokenIds(Sequence[int]):
    """Token ids held as their packed payload (`packed`); a read-only sequence of ints.

    Equal to (and hashing like) any sequence of the same ids, so a tuple of ints and this
    stand for the same prompt."""

    __slots__ = ("_ids", "packed")

    def __init__(self, packed: bytes) -> None:
        self.packed = packed
        self._ids: tuple[int, ...] | None = None

    @classmethod
    def of(cls, token_ids: Iterable[int]) -> PackedTokenIds:
        return cls(pack_token_ids(token_ids))

    def ids(self) -> tuple[int, ...]:
        if self._ids is None:
            self._ids = unpack_token_ids(self.packed)
        return self._ids

    def __len__(self) -> int:
        return count_token_ids(self.packed)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        return self.ids()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    def __bool__(self) -> bool:
        return bool(self.packed)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedTokenIds):
            return self.packed == other.packed
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return self.ids() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.ids())

    def __repr__(self) -> str:
        return f"PackedTokenIds({list(self.ids())!r})"
