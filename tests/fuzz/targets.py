"""Fuzz targets: every parser of bytes from outside, each with the inputs to draw, how raw bytes
map to an input (atheris) and what must come out (the message parsers here; the HTTP/2 frame
layer in `h2core_targets`, the transports in `transport_targets`, the engine's request handling
in `engine_targets`). A target's `check` asserts the outcome is a valid result or an error of
the right kind (anything else raised is a finding). `TARGETS` is the one table both engines use.
tests/fuzz/test_fuzz.py runs each briefly; benchmarks/fuzz_long.py runs them long and reports
crashes, hangs and peak memory.

Inputs mix raw bytes with well-formed inputs that are then cut, spliced or mutated, so the
checks reach past the first length or type test.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib

import orjson
import yaml
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
from hypothesis import strategies as st

from kvswitch.epp.config import build_endpoint_picker, static_pool
from kvswitch.epp.contracts import EndpointPicker, ParsedBody, RoutingDecision
from kvswitch.epp.extproc import ExtProcStream, NeedRouting, RequestFinished
from kvswitch.epp.framework import ConfigError
from kvswitch.epp.kvindex.events import KvEventBatchView, batch_from_proto
from kvswitch.epp.kvindex.index import KvBlockIndex
from kvswitch.epp.parsers import default_parsers
from kvswitch.epp.parsers.openai import OpenAIParser
from kvswitch.epp.parsers.sglanggrpc import SglangGrpcParser
from kvswitch.epp.parsers.vllmgrpc import VllmGrpcParser
from kvswitch.errors import InvalidRequest, PayloadTooLarge
from kvswitch.frontend.openai_models import ChatCompletionRequest, CompletionRequest, parse_request
from kvswitch.limits import SAMPLING_DEFAULTS, check_sampling
from kvswitch.protocol import EMBED_PATH, GENERATE_PATH, common_pb2
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.grpc_framing import FrameDecoder, decode_all
from kvswitch.protocol.sglang import SGLANG_EMBED_PATH, SGLANG_GENERATE_PATH
from kvswitch.protocol.sglang import sglang_scheduler_pb2 as sglang_pb
from tests.fuzz.base import Target, mutated
from tests.fuzz.engine_targets import (
    ENGINE_SGLANG,
    ENGINE_SGLANG_EMBED,
    ENGINE_VLLM,
    ENGINE_VLLM_EMBED,
    messages,
)
from tests.fuzz.h2client_core_targets import H2_CLIENT_CORE
from tests.fuzz.h2core_targets import H2_FRAMES, HPACK_BLOCKS
from tests.fuzz.output_targets import MODEL_OUTPUT
from tests.fuzz.raw import CHUNKS, TEXT, Codec
from tests.fuzz.transport_targets import H2_CLIENT, H2_SERVER, HTTP1

__all__ = ["TARGETS", "Target"]


# ---- shared input shapes -------------------------------------------------------------------

_token_ids = st.lists(st.integers(0, 2**32 - 1), max_size=64)
_sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.integers(0, 2**32 - 1), n=st.integers(0, 2**32 - 1),
    stop=st.lists(st.text(max_size=8), max_size=4),
    stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=4),
    logprobs=st.integers(-2**31, 2**31 - 1),
    logit_bias=st.dictionaries(st.integers(-2**31, 2**31 - 1), st.floats(width=32), max_size=4))
_generate = st.one_of(
    st.builds(lambda ids, s, stream: pb.GenerateRequest(
        request_id="r", tokenized=pb.TokenizedInput(input_ids=ids), sampling_params=s,
        stream=stream), _token_ids, _sampling, st.booleans()),
    st.builds(lambda text, s: pb.GenerateRequest(text=text, sampling_params=s),
              st.text(max_size=64), _sampling),
).map(lambda m: m.SerializeToString())


def _grpc_body(message: bytes, compressed: bool, declared_delta: int) -> bytes:
    payload = message
    if compressed:
        compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
        payload = compressor.compress(message) + compressor.flush()
    length = max(0, len(payload) + declared_delta)
    return bytes([1 if compressed else 0]) + struct.pack(">I", length) + payload


_grpc_bodies = mutated(st.builds(_grpc_body, _generate, st.booleans(),
                                  st.sampled_from([0, 0, 0, -1, 1, 2**20])))


# ---- gRPC framing and gzip -----------------------------------------------------------------

def check_grpc_frames(args: tuple[bytes, str | None, int, int]) -> None:
    body, encoding, limit, split = args
    try:
        messages = decode_all(body, encoding=encoding, max_message_bytes=limit)
    except (InvalidRequest, PayloadTooLarge):
        messages = None
    assert messages is None or all(len(m) <= limit for m in messages)
    # Fed in two pieces, the incremental decoder agrees with the whole-body decoder.
    try:
        decoder = FrameDecoder(encoding=encoding, max_message_bytes=limit)
        pieces = decoder.feed(body[:split]) + decoder.feed(body[split:])
        decoder.close()
    except (InvalidRequest, PayloadTooLarge):
        pieces = None
    assert (pieces is None) == (messages is None) and (pieces is None or pieces == messages)


_ENCODINGS = [None, "identity", "gzip", "deflate", "br"]
_LIMITS = [16, 1024, 16 << 20]
GRPC_FRAMES = Target("grpc-frames", st.tuples(
    _grpc_bodies, st.sampled_from(_ENCODINGS), st.sampled_from(_LIMITS), st.integers(0, 64)),
    check_grpc_frames, Codec("bytes", (_ENCODINGS, _LIMITS, 255)))


# ---- protobuf requests (the EPP's vllmgrpc parser) -----------------------------------------

def check_vllmgrpc(args: tuple[bytes, str, str | None]) -> None:
    body, path, encoding = args
    headers = {"grpc-encoding": encoding} if encoding else {}
    try:
        parsed = VllmGrpcParser(max_message_bytes=1 << 16).parse(path, headers, body)
    except (InvalidRequest, PayloadTooLarge):
        return
    assert isinstance(parsed, ParsedBody)
    messages = decode_all(body, encoding=encoding, max_message_bytes=1 << 16)
    request = (pb.EmbedRequest if path == EMBED_PATH else pb.GenerateRequest).FromString(
        messages[0])
    if parsed.prompt_token_ids is not None:  # the packed view reads what protobuf reads
        assert list(parsed.prompt_token_ids) == list(request.tokenized.input_ids)
    if parsed.sampling is not None:
        try:
            check_sampling(parsed.sampling, SAMPLING_DEFAULTS)
        except InvalidRequest:
            pass


_VLLM_PATHS, _GZIP = [GENERATE_PATH, EMBED_PATH], [None, "gzip"]
VLLMGRPC = Target("vllmgrpc-parser", st.tuples(
    _grpc_bodies, st.sampled_from(_VLLM_PATHS), st.sampled_from(_GZIP)), check_vllmgrpc,
    Codec("bytes", (_VLLM_PATHS, _GZIP)))


# ---- protobuf requests (the EPP's sglanggrpc parser) ---------------------------------------

_sglang_bodies = mutated(st.builds(
    _grpc_body, st.one_of(messages(sglang_pb.GenerateRequest), messages(sglang_pb.EmbedRequest)),
    st.booleans(), st.sampled_from([0, 0, 0, -1, 1])))


def check_sglanggrpc(args: tuple[bytes, str, str | None]) -> None:
    body, path, encoding = args
    headers = {"grpc-encoding": encoding} if encoding else {}
    try:
        parsed = SglangGrpcParser(max_message_bytes=1 << 16).parse(path, headers, body)
    except (InvalidRequest, PayloadTooLarge):
        return
    assert isinstance(parsed, ParsedBody)
    messages_in = decode_all(body, encoding=encoding, max_message_bytes=1 << 16)
    request = (sglang_pb.EmbedRequest if path == SGLANG_EMBED_PATH
               else sglang_pb.GenerateRequest).FromString(messages_in[0])
    if parsed.prompt_token_ids is not None:  # the packed view reads what protobuf reads
        assert list(parsed.prompt_token_ids) == list(request.tokenized.input_ids)
    else:
        assert not request.tokenized.input_ids


_SGLANG_PATHS = [SGLANG_GENERATE_PATH, SGLANG_EMBED_PATH]
SGLANGGRPC = Target("sglanggrpc-parser", st.tuples(
    _sglang_bodies, st.sampled_from(_SGLANG_PATHS), st.sampled_from(_GZIP)), check_sglanggrpc,
    Codec("bytes", (_SGLANG_PATHS, _GZIP)))


# ---- OpenAI JSON bodies (the EPP's parser and the frontend's models) -----------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12)
_fields = st.sampled_from(["model", "prompt", "messages", "max_tokens", "max_completion_tokens",
                           "n", "best_of", "logprobs", "top_logprobs", "stop", "stream",
                           "logit_bias", "stop_token_ids", "temperature", "top_k", "seed",
                           "request_id", "echo", "min_tokens", "response_format"])
_openai_body = st.one_of(
    st.dictionaries(_fields, _json, max_size=6),
    st.fixed_dictionaries({"model": st.just("m"), "prompt": st.one_of(
        st.text(max_size=16), _token_ids, st.lists(_token_ids, max_size=3))},
        optional={"n": _json, "stop": _json, "max_tokens": _json, "logit_bias": _json}),
    st.fixed_dictionaries({"model": st.just("m"), "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "x"]), "content": _json}), max_size=3)},
        optional={"logprobs": _json, "top_logprobs": _json, "n": _json}),
    _json)
_openai_bytes = mutated(_openai_body.map(lambda v: json.dumps(v).encode()))


def check_openai(args: tuple[bytes, str]) -> None:
    body, path = args
    try:
        parsed = OpenAIParser().parse(path, {}, body)
    except InvalidRequest:
        parsed = None
    if parsed is not None:
        assert parsed.prompt_token_ids is None or all(
            0 <= t < 2**32 for t in parsed.prompt_token_ids)
        if parsed.sampling is not None:
            try:
                check_sampling(parsed.sampling, SAMPLING_DEFAULTS)
            except InvalidRequest:
                pass
    try:
        decoded = orjson.loads(body)
    except orjson.JSONDecodeError:
        return
    model = ChatCompletionRequest if path.endswith("chat/completions") else CompletionRequest
    try:
        request = parse_request(model, decoded)
    except InvalidRequest as exc:
        assert exc.message
        return
    for message in getattr(request, "messages", None) or ():
        message.for_template()  # what the chat template is given


_OPENAI_PATHS = ["/v1/completions", "/v1/chat/completions"]
OPENAI = Target("openai-json", st.tuples(_openai_bytes, st.sampled_from(_OPENAI_PATHS)),
                check_openai, Codec("bytes", (_OPENAI_PATHS,)))


# ---- EPP config files ----------------------------------------------------------------------

_plugin = st.fixed_dictionaries({"type": st.sampled_from([
    "queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer", "max-score-picker",
    "random-picker", "low-queue-filter", "session-affinity-scorer", "vllmgrpc-parser",
    "precise-prefix-cache-scorer", "nope"])}, optional={
    "name": st.text(max_size=6), "parameters": st.dictionaries(st.sampled_from([
        "threshold", "blockSize", "maxMessageBytes", "headerName", "hashBlockSize",
        "maxNumOfEndpoints", "lruCapacityPerServer"]), _json, max_size=3)})
_config = st.fixed_dictionaries({
    "apiVersion": st.sampled_from(["llm-d.ai/v1alpha1", "x"]),
    "kind": st.sampled_from(["EndpointPickerConfig", "Other"])}, optional={
    "plugins": st.one_of(st.lists(_plugin, max_size=4), _json),
    "schedulingProfiles": st.one_of(st.lists(st.fixed_dictionaries(
        {"name": st.text(max_size=4)}, optional={"plugins": st.lists(st.fixed_dictionaries(
            {"pluginRef": st.text(max_size=6)}, optional={"weight": _json}), max_size=3)}),
        max_size=2), _json),
    "saturationDetector": _json, "featureGates": _json, "flowControl": _json,
    "dataLayer": _json, "requestHandler": _json})
_config_text = st.one_of(_config.map(yaml.safe_dump), mutated(_config.map(
    lambda c: yaml.safe_dump(c).encode())).map(lambda b: b.decode("utf-8", "replace")))


def check_config(text: str) -> None:
    try:
        picker = build_endpoint_picker(text + "\n", static_pool(["127.0.0.1:1"]))
    except ConfigError as exc:
        assert str(exc)
        return
    assert picker.parsers


CONFIG = Target("epp-config", _config_text, check_config, TEXT)


# ---- KV events -----------------------------------------------------------------------------

_block = st.builds(lambda h, ids, size: common_pb2.KvBlock(block_hash=h, token_ids=ids,
                                                           block_size=size),
                   st.integers(-2**63, 2**63 - 1), st.lists(st.integers(0, 2**32 - 1),
                                                            max_size=20), st.integers(0, 32))
_event = st.one_of(
    st.builds(lambda blocks, parent: common_pb2.KvCacheEvent(stored=common_pb2.KvBlocksStored(
        blocks=blocks, parent_block_hash=parent)), st.lists(_block, max_size=4),
        st.integers(-2**63, 2**63 - 1)),
    st.builds(lambda hashes: common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(
        block_hashes=hashes)), st.lists(st.integers(-2**63, 2**63 - 1), max_size=4)),
    st.just(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())))
_batch = st.builds(lambda seq, events: common_pb2.KvEventBatch(
    sequence_number=seq, events=events), st.integers(0, 2**63 - 1),
    st.lists(_event, max_size=6)).map(lambda m: m.SerializeToString())


def check_kv_events(batches: list[bytes]) -> None:
    index = KvBlockIndex(block_size=16)
    index.add_endpoint("e")
    for raw in batches:
        try:  # as the EPP's subscriber reads a batch off the wire
            message = KvEventBatchView.FromString(raw)
        except DecodeError:
            continue
        batch = batch_from_proto(message)
        stats = index.apply("e", batch.events)
        assert min(stats) >= 0
        assert index.num_blocks("e") >= 0


KV_EVENTS = Target("kv-events", st.lists(mutated(_batch), max_size=4), check_kv_events, CHUNKS)

# ---- ext_proc message sequences (what Envoy sends the EPP) ---------------------------------

def _headers(pairs: list[tuple[str, str]], eos: bool) -> bytes:
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]),
        end_of_stream=eos)).SerializeToString()


_header_pairs = st.lists(st.tuples(
    st.sampled_from([":path", "content-type", "content-length", "grpc-encoding",
                     "x-llm-d-inference-objective", "x-llm-d-slo-ttft-ms", "x-request-id",
                     "x-gateway-destination-endpoint-subset"]),
    st.sampled_from(["/v1/completions", GENERATE_PATH, "application/grpc", "application/json",
                     "gzip", "5", "-1", "abc", "", "1e9", "10.0.0.1:1,"])), max_size=6)
_ext_proc_message = st.one_of(
    st.builds(_headers, _header_pairs, st.booleans()),
    st.builds(lambda body, eos: ep.ProcessingRequest(request_body=ep.HttpBody(
        body=body, end_of_stream=eos)).SerializeToString(),
        st.one_of(_grpc_bodies, _openai_bytes), st.booleans()),
    st.just(ep.ProcessingRequest(request_trailers=ep.HttpTrailers()).SerializeToString()),
    st.builds(lambda pairs: ep.ProcessingRequest(response_headers=ep.HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode())
                                   for k, v in pairs]))).SerializeToString(), _header_pairs),
    st.binary(max_size=64))


class _Bugs(logging.Handler):
    """Counts the ERROR records the stream logs: it logs a bug (an exception it did not mean)
    before answering 500, so a record here is a finding."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def check_ext_proc(messages: list[bytes]) -> None:
    picker = EndpointPicker(parsers=default_parsers(), router=None,  # type: ignore[arg-type]
                            max_body_bytes=1 << 16)
    stream = ExtProcStream(picker, clock=lambda: 0.0)
    bugs = _Bugs()
    logger = logging.getLogger("kvswitch.epp.extproc")
    logger.addHandler(bugs)
    try:
        _feed(stream, messages)
    finally:
        logger.removeHandler(bugs)
    assert not bugs.records, bugs.records[0].getMessage()


def _feed(stream: ExtProcStream, messages: list[bytes]) -> None:
    for raw in messages:
        try:
            message = ep.ProcessingRequest.FromString(raw)
        except DecodeError:
            continue
        for action in stream.receive(message):  # never raises
            assert isinstance(action, (bytes, NeedRouting, RequestFinished))
            if isinstance(action, NeedRouting):
                stream.routed(RoutingDecision(endpoints=("10.0.0.1:1",)))
    stream.close()


EXT_PROC = Target("ext-proc-stream", st.lists(_ext_proc_message, max_size=6), check_ext_proc,
                  CHUNKS)


TARGETS: dict[str, Target] = {t.name: t for t in (
    GRPC_FRAMES, VLLMGRPC, SGLANGGRPC, OPENAI, CONFIG, KV_EVENTS, EXT_PROC, H2_FRAMES, HPACK_BLOCKS,
    H2_SERVER, H2_CLIENT, HTTP1, H2_CLIENT_CORE, ENGINE_VLLM, ENGINE_SGLANG, ENGINE_VLLM_EMBED,
    ENGINE_SGLANG_EMBED, MODEL_OUTPUT)}
