"""The SglangScheduler servicer over the simulator, through a real grpc.aio server and client on
loopback: every RPC, SGLang's response shapes, errors and KV-event pages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from kvswitch.engine.server import EngineServer, ServerOptions
from kvswitch.engine.sglang_kv_events import page_hash, split_pages
from kvswitch.engine.sim import SimConfig, SimEngine
from kvswitch.protocol import common_pb2
from kvswitch.protocol.headers import QUEUED_OWNERSHIP, USAGE_TRAILER, WITHDRAWN_OWNERSHIP
from kvswitch.protocol.sglang import SGLANG_SERVICE_NAME, sglang_method_path
from kvswitch.protocol.sglang import sglang_scheduler_pb2 as pb
from kvswitch.protocol.sglang import sglang_scheduler_pb2_grpc as rpc
from kvswitch.tokenization import load_tokenizer

PAGE = 4
PROMPT = list(range(100, 132))  # two 16-token blocks


@dataclass
class Served:
    engine: SimEngine
    server: EngineServer
    stub: rpc.SglangSchedulerStub
    channel: grpc.aio.Channel


async def _serve(time_scale: float) -> Served:
    engine = SimEngine(SimConfig(profile="tiny", time_scale=time_scale, mode="echo",
                                 kv_events_coalesce_seconds=0.0))
    server = EngineServer(engine, load_tokenizer(None), ServerOptions(
        port=0, grace_period=1.0, api="sglang", page_size=PAGE))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return Served(engine, server, rpc.SglangSchedulerStub(channel), channel)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    s = await _serve(1e6)
    yield s
    await s.channel.close()
    await s.server.stop(0)


def gen(rid: str, ids: list[int] | None = None, *, stream: bool = False, **params: object
        ) -> pb.GenerateRequest:
    sampling: dict[str, object] = {"temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                   "repetition_penalty": 1.0}
    sampling.update(params)
    return pb.GenerateRequest(request_id=rid, stream=stream,
                              tokenized=pb.TokenizedInput(input_ids=PROMPT if ids is None else ids),
                              sampling_params=pb.SamplingParams(
                                  **sampling))  # type: ignore[arg-type]


def kinds(messages: list[pb.GenerateResponse]) -> list[str]:
    return [str(m.WhichOneof("response")) for m in messages]


async def test_unary_is_one_complete_with_every_id(served: Served) -> None:
    call = served.stub.Generate(gen("u1", max_new_tokens=5))
    messages = [m async for m in call]
    assert kinds(messages) == ["complete"]
    c = messages[0].complete
    assert messages[0].request_id == "u1"
    assert list(c.output_ids) == PROMPT[:5]  # echo mode
    assert (c.finish_reason, c.prompt_tokens, c.completion_tokens) == ("length", 32, 5)
    trailer = dict(await call.trailing_metadata())[USAGE_TRAILER]
    assert trailer == "prompt_tokens=32;completion_tokens=5;cached_tokens=0"


async def test_stream_chunks_are_deltas_with_cumulative_counts(served: Served) -> None:
    messages = [m async for m in served.stub.Generate(gen("s1", stream=True, max_new_tokens=6))]
    assert kinds(messages)[-2:] == ["chunk", "complete"]
    chunks = [m.chunk for m in messages if m.HasField("chunk")]
    assert [t for c in chunks for t in c.token_ids] == PROMPT[:6]
    counts = [c.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert counts[0] == len(chunks[0].token_ids)
    complete = messages[-1].complete
    assert list(complete.output_ids) == list(chunks[-1].token_ids)  # the last delta, repeated
    assert complete.completion_tokens == 6 and complete.finish_reason == "length"


async def test_eos_and_stop_token_report_the_matched_token(served: Served) -> None:
    eos = served.engine.model.eos_token_ids[0]
    messages = [m async for m in served.stub.Generate(gen("e1", PROMPT[:3]))]
    c = messages[-1].complete
    assert list(c.output_ids) == [*PROMPT[:3], eos]
    assert c.finish_reason == "stop" and c.matched_token_id == eos
    messages = [m async for m in served.stub.Generate(
        gen("e2", stop_token_ids=[PROMPT[2]], max_new_tokens=10))]
    c = messages[-1].complete
    assert c.finish_reason == "stop" and c.matched_token_id == PROMPT[2]


async def test_n2_unary_and_streamed_give_a_complete_per_index(served: Served) -> None:
    messages = [m async for m in served.stub.Generate(gen("n1", n=2, max_new_tokens=3))]
    assert [m.complete.index for m in messages] == [0, 1]
    assert all(m.complete.completion_tokens == 3 for m in messages)
    messages = [m async for m in served.stub.Generate(gen("n2", n=2, stream=True,
                                                          max_new_tokens=3))]
    completes = [m.complete for m in messages if m.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1]
    for index in (0, 1):
        ids = [t for m in messages if m.HasField("chunk") and m.chunk.index == index
               for t in m.chunk.token_ids]
        assert ids == PROMPT[:3]


async def test_repeated_prompt_reports_cached_tokens(served: Served) -> None:
    [m async for m in served.stub.Generate(gen("c1", max_new_tokens=2))]
    messages = [m async for m in served.stub.Generate(gen("c2", max_new_tokens=2))]
    assert messages[-1].complete.cached_tokens >= 16


async def test_prefill_only_and_logprobs(served: Served) -> None:
    messages = [m async for m in served.stub.Generate(gen("p1", max_new_tokens=0))]
    c = messages[-1].complete
    assert list(c.output_ids) == [] and c.finish_reason == "length" and c.completion_tokens == 0
    request = gen("p2", max_new_tokens=2)
    request.return_logprob, request.top_logprobs_num, request.logprob_start_len = True, 2, 30
    c = [m async for m in served.stub.Generate(request)][-1].complete
    assert len(c.output_logprobs.token_logprobs) == 2 and len(c.output_logprobs.top_logprobs) == 2
    assert list(c.input_logprobs.token_ids) == PROMPT[30:]


@pytest.mark.parametrize(("request_", "words"), [
    (gen("x", top_p=2.0), "top_p"),
    (gen("x", temperature=-1.0), "temperature"),
    (gen("x", top_k=-5), "top_k"),
    (gen("x", n=1000), "n must be at most"),
    (gen("x", []), "input_ids is empty"),
    (gen("x", [10**7]), "out of the vocabulary"),
    (gen("x", list(range(1, 1100))), "exceeds the maximum allowed length"),
    (gen("x", max_new_tokens=5000), "maximum context length"),
    (pb.GenerateRequest(request_id="x"), "Tokenized input must be provided"),
    (pb.GenerateRequest(request_id="x", lora_id="a", tokenized=pb.TokenizedInput(
        input_ids=[1])), "LoRA is not enabled"),
    (pb.GenerateRequest(request_id="x", return_hidden_states=True, tokenized=pb.TokenizedInput(
        input_ids=[1])), "--enable-return-hidden-states"),
    (pb.GenerateRequest(request_id="x", mm_inputs=pb.MultimodalInputs(image_urls=["u"]),
                        tokenized=pb.TokenizedInput(input_ids=[1])), "multimodal"),
])
async def test_bad_requests_are_invalid_argument(served: Served, request_: pb.GenerateRequest,
                                                 words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [m async for m in served.stub.Generate(request_)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (info.value.details() or "")


async def test_undecodable_request_is_invalid_argument(served: Served) -> None:
    call = served.channel.unary_stream(sglang_method_path("Generate"))(b"\xff\xff\xff")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [m async for m in call]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_abort_rpc_ends_the_stream_as_sglang_does() -> None:
    s = await _serve(1.0)  # real time: the request is still running when Abort comes
    try:
        call = s.stub.Generate(gen("a1", stream=True, max_new_tokens=900, ignore_eos=True))
        first = await call.read()
        assert first.HasField("chunk")
        answer = await s.stub.Abort(pb.AbortRequest(request_id="a1"))
        assert answer.success and "aborted" in answer.message
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await call.read() is not grpc.aio.EOF:
                pass
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert info.value.details() == "Request aborted"
        assert not s.engine.has_request("a1")
        unknown = await s.stub.Abort(pb.AbortRequest(request_id="nobody"))
        assert unknown.success
    finally:
        await s.channel.close()
        await s.server.stop(0)


async def test_a_cancelled_or_expired_call_frees_its_request() -> None:
    s = await _serve(1.0)
    try:
        call = s.stub.Generate(gen("c1", stream=True, max_new_tokens=900, ignore_eos=True))
        assert (await call.read()).HasField("chunk")
        assert s.engine.has_request("c1")
        call.cancel()
        async with asyncio.timeout(5):
            while s.engine.has_request("c1"):
                await asyncio.sleep(0.01)
        late = s.stub.Generate(gen("c2", max_new_tokens=900, ignore_eos=True), timeout=0.2)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [m async for m in late]
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        async with asyncio.timeout(5):
            while s.engine.has_request("c2"):
                await asyncio.sleep(0.01)
        assert s.engine.load().running == 0
    finally:
        await s.channel.close()
        await s.server.stop(0)


async def test_embed_and_management_rpcs(served: Served) -> None:
    embed = await served.stub.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(
        input_ids=[1, 2, 3])))
    assert embed.prompt_tokens == 3 and embed.embedding_dim == len(embed.embedding) > 0
    health = await served.stub.HealthCheck(pb.HealthCheckRequest())
    assert health.healthy
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_context_length == 1024 and info.max_req_input_len == 1023
    assert list(info.eos_token_ids) == list(served.engine.model.eos_token_ids)
    server = await served.stub.GetServerInfo(pb.GetServerInfoRequest())
    assert server.server_type == "grpc" and server.server_args["page_size"] == PAGE
    assert server.max_total_num_tokens == 64 * 16
    loads = await served.stub.GetLoads(pb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].HasField("memory")
    assert loads.loads[0].max_total_num_tokens == 64 * 16
    core = await served.stub.GetLoads(pb.GetLoadsRequest(include=["core"]))
    assert not core.loads[0].HasField("memory")
    assert not (await served.stub.GetLoads(pb.GetLoadsRequest(dp_rank=1))).loads
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await served.stub.GetLoads(pb.GetLoadsRequest(include=["everything"]))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    lora = await served.stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="a"))
    assert not lora.success and "--enable-lora" in lora.message
    assert not (await served.stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest())).success
    listed = await served.stub.ListLoadedLoRAAdapters(pb.ListLoadedLoRAAdaptersRequest())
    assert not listed.loaded_adapters
    assert (await served.stub.StartProfile(common_pb2.StartProfileRequest())).success
    assert (await served.stub.StopProfile(common_pb2.StopProfileRequest())).success
    assert (await served.stub.FlushCache(common_pb2.FlushCacheRequest())).success
    chunks = [c async for c in served.stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
    assert chunks and chunks[-1].sha256


async def test_kv_events_are_pages(served: Served) -> None:
    events = served.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    [m async for m in served.stub.Generate(gen("k1", max_new_tokens=1))]
    stored: list[common_pb2.KvBlock] = []
    parent = None
    async with asyncio.timeout(10):
        while len(stored) < 8:
            batch = await events.read()
            for event in batch.events:
                if event.HasField("stored"):
                    if not stored:
                        parent = event.stored.HasField("parent_block_hash")
                    stored.extend(event.stored.blocks)
    events.cancel()
    assert parent is False
    assert [list(b.token_ids) for b in stored[:8]] == [PROMPT[i:i + PAGE] for i in range(0, 32, 4)]
    assert {b.block_size for b in stored} == {PAGE}
    assert len({b.block_hash for b in stored}) == len(stored)


def test_split_pages_keeps_parents_and_maps_removals() -> None:
    batch = common_pb2.KvEventBatch(events=[
        common_pb2.KvCacheEvent(stored=common_pb2.KvBlocksStored(parent_block_hash=7, blocks=[
            common_pb2.KvBlock(block_hash=9, token_ids=list(range(8)), block_size=8)])),
        common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(block_hashes=[9]))])
    split_pages(batch, 4, 8)
    stored, removed = batch.events[0].stored, batch.events[1].removed
    assert stored.parent_block_hash == 7
    assert [b.block_hash for b in stored.blocks] == [page_hash(9, 0), 9]
    assert [list(b.token_ids) for b in stored.blocks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(removed.block_hashes) == [page_hash(9, 0), 9]


def test_split_pages_leaves_the_announcements_of_queued_prompts_whole() -> None:
    announced = common_pb2.KvBlocksStored(ownership=QUEUED_OWNERSHIP, session_id="r1", blocks=[
        common_pb2.KvBlock(token_ids=list(range(8)), block_size=8)])
    withdrawn = common_pb2.KvBlocksStored(ownership=WITHDRAWN_OWNERSHIP, session_id="r0")
    batch = common_pb2.KvEventBatch(events=[common_pb2.KvCacheEvent(stored=announced),
                                            common_pb2.KvCacheEvent(stored=withdrawn)])
    split_pages(batch, 1, 8)
    assert batch.events[0].stored == announced and batch.events[1].stored == withdrawn


async def test_health_and_reflection_name_the_sglang_service(served: Served) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(served.channel)
    answer = await stub.Check(health_pb2.HealthCheckRequest(service=SGLANG_SERVICE_NAME))
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
