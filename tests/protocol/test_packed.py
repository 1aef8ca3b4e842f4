"""Token ids in packed wire form: the views, the sequence over them, and hashing alike."""

from __future__ import annotations

import pytest

from kvswitch.engine.base import KvBlockStored, KvEventBatchData
from kvswitch.engine.kv_events import batch_events
from kvswitch.epp.kvindex import KvBlockIndex, batch_from_proto, chained_block_hashes
from kvswitch.epp.parsers.vllmgrpc import VllmGrpcParser
from kvswitch.errors import InvalidRequest
from kvswitch.protocol import EMBED_PATH, GENERATE_PATH, common_pb2, vllm_engine_pb2
from kvswitch.protocol.grpc_framing import encode
from kvswitch.protocol.packed import (
    EmbedRequestView,
    GenerateRequestView,
    KvEventBatchView,
    PackedTokenIds,
    count_token_ids,
    pack_token_ids,
    unpack_token_ids,
)

# Every varint length a uint32 takes: 1 byte below 128, up to 5 bytes for 2**32 - 1.
IDS = [0, 1, 127, 128, 16383, 16384, 2_097_151, 2_097_152, 151_935, 2**32 - 1]


def test_pack_unpack_and_count_round_trip_every_varint_length() -> None:
    packed = pack_token_ids(IDS)
    assert len(packed) == 1 + 1 + 1 + 2 + 2 + 3 + 3 + 4 + 3 + 5
    assert unpack_token_ids(packed) == tuple(IDS)
    assert count_token_ids(packed) == len(IDS)
    assert pack_token_ids([]) == b"" and unpack_token_ids(b"") == ()


def test_packed_token_ids_is_a_sequence_equal_to_its_ids() -> None:
    ids = PackedTokenIds.of(IDS)
    assert len(ids) == len(IDS) and list(ids) == IDS
    assert ids[3] == 128 and ids[-1] == 2**32 - 1 and ids[2:4] == (127, 128)
    assert ids == tuple(IDS) and ids == IDS and hash(ids) == hash(tuple(IDS))
    assert ids == PackedTokenIds(pack_token_ids(IDS)) and ids != PackedTokenIds.of(IDS[:-1])
    assert not PackedTokenIds(b"") and len(PackedTokenIds(b"")) == 0


def test_views_read_the_ids_as_their_packed_payload_and_keep_other_fields() -> None:
    request = vllm_engine_pb2.GenerateRequest(
        request_id="r1", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=IDS), stream=True,
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=7))
    view = GenerateRequestView.FromString(request.SerializeToString())
    assert view.tokenized.input_ids == pack_token_ids(IDS)
    assert (view.request_id, view.stream, view.sampling_params.max_tokens) == ("r1", True, 7)
    embed = vllm_engine_pb2.EmbedRequest(tokenized=vllm_engine_pb2.TokenizedInput(input_ids=IDS))
    assert EmbedRequestView.FromString(embed.SerializeToString()).tokenized.input_ids == \
        pack_token_ids(IDS)
    batch = common_pb2.KvEventBatch(sequence_number=3, events=[common_pb2.KvCacheEvent(
        stored=common_pb2.KvBlocksStored(blocks=[common_pb2.KvBlock(
            block_hash=-9, token_ids=IDS, block_size=16)]))])
    block = KvEventBatchView.FromString(batch.SerializeToString()).events[0].stored.blocks[0]
    assert (block.block_hash, block.token_ids) == (-9, pack_token_ids(IDS))


def _parsed(path: str, message: bytes) -> PackedTokenIds:
    body = VllmGrpcParser().parse(path, {}, encode(message))
    assert isinstance(body.prompt_token_ids, PackedTokenIds)
    return body.prompt_token_ids


def test_the_parser_keeps_a_tokenized_prompt_packed() -> None:
    generate = vllm_engine_pb2.GenerateRequest(
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=IDS)).SerializeToString()
    assert _parsed(GENERATE_PATH, generate).packed == pack_token_ids(IDS)
    embed = vllm_engine_pb2.EmbedRequest(
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=IDS)).SerializeToString()
    assert _parsed(EMBED_PATH, embed) == IDS


def test_ids_sent_unpacked_are_read_all_the_same() -> None:
    # tokenized (field 2) holding input_ids (field 2) as one varint field per id (wire type 0).
    inner = b"".join(b"\x10" + bytes([i]) for i in (5, 7, 9))
    message = b"\x12" + bytes([len(inner)]) + inner
    assert list(vllm_engine_pb2.GenerateRequest.FromString(message).tokenized.input_ids) == \
        [5, 7, 9]
    assert _parsed(GENERATE_PATH, message) == (5, 7, 9)


@pytest.mark.parametrize("payload", [
    b"\x01\x02\xac",  # the last varint is cut short
    b"\x81" * 11 + b"\x01",  # an 11-byte varint (upb refuses more than 10)
])
def test_a_corrupt_varint_in_the_ids_is_invalid(payload: bytes) -> None:
    # The view alone would take any payload: the real schema's parse catches these.
    inner = b"\x12" + bytes([len(payload)]) + payload
    message = b"\x12" + bytes([len(inner)]) + inner
    GenerateRequestView.FromString(message)
    with pytest.raises(InvalidRequest, match="malformed GenerateRequest"):
        VllmGrpcParser().parse(GENERATE_PATH, {}, encode(message))


def test_a_parsed_prompt_hashes_like_the_engine_blocks_that_hold_it() -> None:
    # The index's two inputs: a prompt the parser left packed, and the engine's KV event for
    # the same tokens, read through the KV view. Their block hashes must agree.
    prompt = [100 + 997 * i for i in range(40)]  # 2 full blocks of 16 + 8
    message = vllm_engine_pb2.GenerateRequest(
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt)).SerializeToString()
    hashes = chained_block_hashes(_parsed(GENERATE_PATH, message), 16)
    assert hashes == chained_block_hashes(prompt, 16) and len(hashes) == 2
    stored = (KvBlockStored(11, None, tuple(prompt[:16])),
              KvBlockStored(12, 11, tuple(prompt[16:32])))
    wire = common_pb2.KvEventBatch(sequence_number=0, events=batch_events(
        KvEventBatchData(0, 0.0, stored), 16, 1)).SerializeToString()
    index = KvBlockIndex(16)
    index.apply("engine", batch_from_proto(KvEventBatchView.FromString(wire)).events)
    assert index.match(hashes) == {"engine": 2}
