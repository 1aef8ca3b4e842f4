"""Fuzz targets for the engine's request handling: `GenerateRequest` and `EmbedRequest`
protobufs (vLLM's and SGLang's) into the servicer's `Generate` and `Embed` over the simulator,
as a direct gRPC client sends them. The check: Generate streams its first answer, Embed answers
an embedding of `embedding_dim` values, or the call aborts with INVALID_ARGUMENT (or, for a
request the engine may refuse for load, RESOURCE_EXHAUSTED / UNAVAILABLE); an INTERNAL or
UNKNOWN answer, or an exception out of the handler, is a finding. Only Generate's first answer
is read, then the call is closed (which aborts the request), so an input costs little.

Requests are drawn field by field from the message descriptors, so every field is reached,
then serialized and sometimes mutated.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import strategies as st

from kvswitch.engine.servicer import VllmEngineServicer
from kvswitch.engine.sglang_servicer import SglangSchedulerServicer
from kvswitch.engine.sim import SimConfig, SimEngine
from kvswitch.protocol import vllm_engine_pb2
from kvswitch.protocol.sglang import sglang_scheduler_pb2
from kvswitch.tokenization import load_tokenizer
from tests.fuzz.base import Target, mutated

__all__ = ["ENGINE_SGLANG", "ENGINE_SGLANG_EMBED", "ENGINE_VLLM", "ENGINE_VLLM_EMBED", "messages"]

_ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNAVAILABLE}
_F = FieldDescriptor
# Strings that mean something to some field: constraints (regex, JSON schema, choices), stops.
_STRINGS = ["a|b", "(", "[a-", "\\", "x{2,1}", '["a"]', "[]", "{", '{"type": "object"}',
            '{"type": "array", "minItems": 100000}', '{"$ref": "#"}', '{"enum": []}',
            '{"type": "string", "pattern": "("}', '{"type": "integer", "minimum": 5, "maximum": 1}',
            '{"type": "string", "minLength": 100000}', '{"anyOf": []}', "null", "1e999",
            "[" * 2000, '{"a": ' * 2000]  # nested past Python's recursion limit
_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    _F.TYPE_INT32: st.integers(-2**31, 2**31 - 1) | st.integers(-2, 8),
    _F.TYPE_SINT32: st.integers(-2**31, 2**31 - 1),
    _F.TYPE_SFIXED32: st.integers(-2**31, 2**31 - 1),
    _F.TYPE_UINT32: st.integers(0, 2**32 - 1) | st.integers(0, 40),
    _F.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    _F.TYPE_INT64: st.integers(-2**63, 2**63 - 1) | st.integers(-2, 8),
    _F.TYPE_SINT64: st.integers(-2**63, 2**63 - 1),
    _F.TYPE_SFIXED64: st.integers(-2**63, 2**63 - 1),
    _F.TYPE_UINT64: st.integers(0, 2**64 - 1), _F.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    _F.TYPE_FLOAT: st.floats(width=32) | st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0]),
    _F.TYPE_DOUBLE: st.floats() | st.sampled_from([0.0, 0.5, 1.0, -1.0]),
    _F.TYPE_BOOL: st.booleans(),
    _F.TYPE_STRING: st.text(max_size=12) | st.sampled_from(_STRINGS),
    _F.TYPE_BYTES: st.binary(max_size=12),
}


def _message(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """A dict of some of the message's fields (by name) with values of their types."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == _F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            key, item = (field.message_type.fields_by_name[k] for k in ("key", "value"))
            if item.type == _F.TYPE_MESSAGE:
                continue
            fields[field.name] = st.dictionaries(_SCALARS[key.type], _SCALARS[item.type],
                                                 max_size=4)
            continue
        if field.type == _F.TYPE_MESSAGE:
            if depth >= 3:
                continue
            value = _message(field.message_type, depth + 1)
        elif field.type == _F.TYPE_ENUM:
            value = st.sampled_from([v.number for v in field.enum_type.values])
        else:
            value = _SCALARS[field.type]
        is_repeated = field.is_repeated
        fields[field.name] = st.lists(value, max_size=6) if is_repeated else value
    return st.fixed_dictionaries({}, optional=fields)


def messages(cls: type[Message]) -> st.SearchStrategy[bytes]:
    """Serialized messages of `cls` with any of their fields set."""

    def build(fields: dict[str, Any]) -> bytes:
        message = cls()
        _fill(message, fields)
        return message.SerializeToString()

    return _message(cls.DESCRIPTOR).map(build)


def _fill(message: Message, fields: dict[str, Any]) -> None:
    for name, value in fields.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        try:
            if isinstance(value, dict) and field.is_repeated:  # a map
                getattr(message, name).update(value)
            elif field.type == _F.TYPE_MESSAGE:
                if field.is_repeated:
                    for item in value:
                        _fill(getattr(message, name).add(), item)
                else:
                    sub = getattr(message, name)
                    sub.SetInParent()
                    _fill(sub, value)
            elif field.is_repeated:
                getattr(message, name).extend(value)
            else:
                setattr(message, name, value)
        except (TypeError, ValueError):
            pass  # e.g. a second member of a oneof, or a float that does not fit


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class _Context:
    """The servicer's view of a call: `abort` raises, as grpc.aio's does."""

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Any = ()) -> None:
        raise _Aborted(code, details)

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    async def send_initial_metadata(self, metadata: Any) -> None:
        pass


class _Served:
    """One simulator and servicer per process, on a loop of their own that every input reuses."""

    def __init__(self, api: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = SimEngine(SimConfig(profile="tiny", time_scale=1e6, mode="echo"))
        self.loop.run_until_complete(self.engine.start())
        kind = SglangSchedulerServicer if api == "sglang" else VllmEngineServicer
        self.servicer = kind(self.engine, load_tokenizer(None))


_served: dict[str, _Served] = {}


def _decoded(api: str, cls: type[Message], raw: bytes) -> tuple[_Served, Any] | None:
    """The engine serving `api` and the request, or None when `raw` does not decode (answered
    INVALID_ARGUMENT before the handler runs: kvswitch.engine.registration)."""
    try:
        request = cls.FromString(raw)
    except DecodeError:
        return None
    return _served.get(api) or _served.setdefault(api, _Served(api)), request


def _check_generate(api: str, cls: type[Message], raw: bytes) -> None:
    if (decoded := _decoded(api, cls, raw)) is None:
        return
    served, request = decoded

    async def first_answer() -> None:
        call = served.servicer.Generate(request, _Context())
        try:
            await call.__anext__()
        except StopAsyncIteration:
            pass
        except _Aborted as exc:
            assert exc.code in _ALLOWED, str(exc)
        finally:
            await call.aclose()

    served.loop.run_until_complete(first_answer())


def _check_embed(api: str, cls: type[Message], raw: bytes) -> None:
    if (decoded := _decoded(api, cls, raw)) is None:
        return
    served, request = decoded

    async def answer() -> None:
        try:
            reply = await served.servicer.Embed(request, _Context())
        except _Aborted as exc:
            assert exc.code in _ALLOWED, str(exc)
            return
        assert len(reply.embedding) == reply.embedding_dim > 0, reply

    served.loop.run_until_complete(answer())


ENGINE_VLLM = Target(
    "engine-vllm-generate", mutated(messages(vllm_engine_pb2.GenerateRequest)),
    lambda raw: _check_generate("vllm", vllm_engine_pb2.GenerateRequest, raw))
ENGINE_SGLANG = Target(
    "engine-sglang-generate", mutated(messages(sglang_scheduler_pb2.GenerateRequest)),
    lambda raw: _check_generate("sglang", sglang_scheduler_pb2.GenerateRequest, raw))
ENGINE_VLLM_EMBED = Target(
    "engine-vllm-embed", mutated(messages(vllm_engine_pb2.EmbedRequest)),
    lambda raw: _check_embed("vllm", vllm_engine_pb2.EmbedRequest, raw))
ENGINE_SGLANG_EMBED = Target(
    "engine-sglang-embed", mutated(messages(sglang_scheduler_pb2.EmbedRequest)),
    lambda raw: _check_embed("sglang", sglang_scheduler_pb2.EmbedRequest, raw))
