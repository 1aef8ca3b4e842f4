"""Protobuf <-> contract conversion: vLLM's defaults, vLLM's validation, vLLM's response shapes."""

from __future__ import annotations

import pytest

from kvswitch.engine import conversion
from kvswitch.engine.base import (
    GenerationUpdate,
    KvBlockStored,
    KvEventBatchData,
    SamplingOptions,
    SequenceDelta,
    TokenLogprob,
)
from kvswitch.engine.kv_events import batch_events, to_int64
from kvswitch.errors import InvalidRequest
from kvswitch.protocol import vllm_engine_pb2 as pb
from tests.engine.fake_engine import CARD


def convert(**fields: object) -> SamplingOptions:
    return conversion.sampling_from_proto(pb.SamplingParams(**fields), CARD)


def test_unset_fields_take_vllms_defaults() -> None:
    o = convert()
    assert (o.temperature, o.top_p, o.repetition_penalty, o.n) == (1.0, 1.0, 1.0, 1)
    assert o.max_tokens is None and o.seed is None and o.logprobs is None
    assert o.prompt_logprobs is None and o.constraint is None


def test_set_fields_pass_through() -> None:
    o = convert(temperature=0.0, top_p=0.5, top_k=40, min_p=0.1, max_tokens=7, min_tokens=2,
                seed=3, n=2, stop=["x"], stop_token_ids=[5], logprobs=0, prompt_logprobs=2,
                logit_bias={11: 1.5}, ignore_eos=True, json_schema='{"type":"object"}')
    assert o.temperature == 0.0 and o.top_p == 0.5 and o.top_k == 40
    assert (o.max_tokens, o.min_tokens, o.seed, o.n) == (7, 2, 3, 2)
    assert o.stop == ("x",) and o.stop_token_ids == (5,) and o.ignore_eos
    assert (o.logprobs, o.prompt_logprobs) == (0, 2) and dict(o.logit_bias) == {11: 1.5}
    assert o.constraint == ("json_schema", '{"type":"object"}')


def test_choice_constraint_becomes_a_json_list() -> None:
    o = convert(choice=pb.ChoiceConstraint(choices=["yes", "no"]))
    assert o.constraint == ("choice", '["yes", "no"]')


@pytest.mark.parametrize(("fields", "field"), [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"top_k": 10_000_000}, "top_k"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": -2}, "logprobs"),
    ({"prompt_logprobs": 30}, "prompt_logprobs"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": [10_000_000]}, "stop_token_ids"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
])
def test_invalid_sampling_names_the_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        convert(**fields)
    assert info.value.param == field
    assert field in info.value.message


def test_top_k_minus_one_cast_to_uint32_means_disabled() -> None:
    assert convert(top_k=2**32 - 1).top_k == 0


@pytest.mark.parametrize(("ids", "needle"), [
    ([], "cannot be empty"), ([10_000_000], "out of vocabulary"),
    (list(range(1, 300)), "longer than the maximum model length"),
])
def test_bad_prompts_are_refused(ids: list[int], needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        conversion.check_prompt(ids, CARD)


def test_truncate_prompt_tokens_keeps_the_tail() -> None:
    params = pb.SamplingParams(truncate_prompt_tokens=2)
    assert conversion.truncate_prompt([1, 2, 3], params, CARD) == [2, 3]
    with pytest.raises(InvalidRequest, match="truncate_prompt_tokens"):
        conversion.truncate_prompt([1], pb.SamplingParams(truncate_prompt_tokens=0), CARD)


def test_kv_transfer_params_need_host_and_port() -> None:
    request = pb.GenerateRequest(kv_transfer_params=pb.KvTransferParams(remote_host="h"))
    with pytest.raises(InvalidRequest, match="remote_host and remote_port must be set"):
        conversion.check_kv_transfer(request)
    ok = pb.GenerateRequest(kv_transfer_params=pb.KvTransferParams(remote_host="h",
                                                                   remote_port=1))
    conversion.check_kv_transfer(ok)
    with pytest.raises(InvalidRequest, match="kv_transfer_params_json"):
        conversion.check_kv_transfer(pb.GenerateRequest(kv_transfer_params_json="[1]"))


def _update(seqs: list[SequenceDelta], finished: bool) -> GenerationUpdate:
    return GenerationUpdate("r", 3, 1, seqs, finished)


def test_stream_sends_delta_chunks_and_a_complete_with_the_last_delta() -> None:
    builder = conversion.ResponseBuilder([1, 2, 3], SamplingOptions(), stream=True)
    first = builder.feed(_update([SequenceDelta(0, [7, 8])], False))
    last = builder.feed(_update([SequenceDelta(0, [9], finish_reason="stop", matched_stop=9)],
                                True))
    assert [m.WhichOneof("response") for m in first + last] == ["chunk", "chunk", "complete"]
    assert list(first[0].chunk.token_ids) == [7, 8] and first[0].chunk.completion_tokens == 2
    complete = last[1].complete
    assert list(complete.output_ids) == [9] and complete.finish_reason == "stop"
    assert complete.matched_token_id == 9 and complete.cached_tokens == 1
    assert builder.usage_trailer() == "prompt_tokens=3;completion_tokens=3;cached_tokens=1"


def test_non_stream_accumulates_one_complete_per_index_in_order() -> None:
    builder = conversion.ResponseBuilder([1, 2, 3], SamplingOptions(n=2), stream=False)
    assert builder.feed(_update([SequenceDelta(1, [5]), SequenceDelta(0, [4])], False)) == []
    out = builder.feed(_update([SequenceDelta(1, [6], finish_reason="length"),
                                SequenceDelta(0, [], finish_reason="stop", matched_stop="x")],
                               True))
    assert [m.complete.index for m in out] == [0, 1]
    assert list(out[1].complete.output_ids) == [5, 6] and out[1].complete.completion_tokens == 2
    assert out[0].complete.matched_stop_str == "x"


def test_logprobs_are_shaped_like_vllms() -> None:
    lp = [TokenLogprob(7, -0.1, ((7, -0.1), (8, -2.0), (9, -3.0)))]
    out = conversion.output_logprobs(lp, 2)
    assert out is not None and list(out.token_ids) == [7]
    assert list(out.top_logprobs[0].token_ids) == [7, 8]
    assert not conversion.output_logprobs(lp, 0).top_logprobs  # type: ignore[union-attr]
    inp = conversion.input_logprobs([None, TokenLogprob(2, -1.0, ((2, -1.0),))], [1, 2], 1)
    assert inp is not None and not inp.token_logprobs[0].HasField("value")
    assert inp.token_logprobs[1].value == -1.0 and list(inp.top_logprobs[1].token_ids) == [2]


def test_kv_batches_group_chained_blocks_and_wrap_hashes() -> None:
    big = (1 << 64) - 5
    data = KvEventBatchData(1, 0.0, stored=(KvBlockStored(big, None, (1, 2)),
                                            KvBlockStored(7, big, (3, 4)),
                                            KvBlockStored(9, 3, (5, 6))), removed=(11,))
    events = batch_events(data, 2, first_event_id=10)
    kinds = [e.WhichOneof("data") for e in events]
    assert kinds == ["removed", "stored", "stored"]
    assert [e.event_id for e in events] == [10, 11, 12]
    assert [b.block_hash for b in events[1].stored.blocks] == [-5, 7]
    assert not events[1].stored.HasField("parent_block_hash")
    assert events[2].stored.parent_block_hash == 3 and to_int64(big) == -5


def test_kv_batches_keep_each_chain_in_one_event_across_interleaved_steps() -> None:
    # Two requests decoding in the same coalesced batch: their blocks arrive interleaved, one
    # per step. Each chain is one event; a block whose parent is inside a chain (a shared
    # prefix) starts its own event, after the event that holds its parent.
    stored = (KvBlockStored(1, None, (0, 0)), KvBlockStored(2, 1, (0, 1)),   # A: prompt
              KvBlockStored(10, 1, (5, 5)),                                 # B: forks after 1
              KvBlockStored(3, 2, (0, 2)), KvBlockStored(11, 10, (5, 6)),   # decode steps
              KvBlockStored(4, 3, (0, 3)), KvBlockStored(12, 11, (5, 7)),
              KvBlockStored(20, 99, (7, 7)))                                # C: parent unseen
    events = batch_events(KvEventBatchData(1, 0.0, stored=stored), 2, first_event_id=1)
    chains = [([b.block_hash for b in e.stored.blocks],
               e.stored.parent_block_hash if e.stored.HasField("parent_block_hash") else None)
              for e in events]
    assert chains == [([1, 2, 3, 4], None), ([10, 11, 12], 1), ([20], 99)]
    assert [e.event_id for e in events] == [1, 2, 3]
