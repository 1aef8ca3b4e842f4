"""The load push: with two KV-event subscribers, an arrival reaches both as a load-only record
within a few ms, long before the coalescing window or a heartbeat would bring it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from kvswitch.engine import kv_events
from kvswitch.engine.base import KvEventBatchData, QueuedPrompt
from kvswitch.engine.server import EngineServer, ServerOptions
from kvswitch.engine.sim import SimConfig, SimEngine
from kvswitch.protocol import common_pb2, vllm_engine_pb2_grpc
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.headers import QUEUED_OWNERSHIP, QUEUED_PROMPTS, WITHDRAWN_OWNERSHIP
from kvswitch.tokenization import load_tokenizer
from tests.engine.fake_engine import FakeEngine

LOAD_PUSH = KvEventBatchData(-1, 0.0, load_only=True)


async def first_push(call: grpc.aio.UnaryStreamCall) -> common_pb2.KvEventBatch:
    """The first load-only record after the opening one that shows a request."""
    while True:
        batch = await call.read()
        assert batch is not grpc.aio.EOF
        if batch.load.load_only and batch.load.running_requests + batch.load.waiting_requests:
            return batch


@contextlib.asynccontextmanager
async def serving(engine: SimEngine) -> AsyncIterator[
        tuple[EngineServer, vllm_engine_pb2_grpc.VllmEngineStub]]:
    """The engine's gRPC server on loopback and a stub; closing the channel ends every call."""
    server = EngineServer(engine, load_tokenizer(None), ServerOptions(port=0, grace_period=1.0))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield server, vllm_engine_pb2_grpc.VllmEngineStub(channel)
    finally:
        await channel.close()
        await server.stop(0)


async def both_follow(engine: SimEngine) -> None:
    while engine._events.followers < 2:  # each stream's pump starts following the log
        await asyncio.sleep(0.01)


async def test_two_subscribers_learn_of_an_arrival_from_a_push(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_events, "HEARTBEAT_SECONDS", 600.0)  # no heartbeat in the way
    # A window far longer than the test: only a push can bring the arrival's load.
    engine = SimEngine(SimConfig(profile="tiny", time_scale=0.1, mode="echo",
                                 kv_events_coalesce_seconds=600.0))
    async with serving(engine) as (server, stub):
        calls = [stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
            load_records_before_first_batch=True)) for _ in range(2)]
        for call in calls:
            opening = await asyncio.wait_for(call.read(), 10.0)
            assert opening.load.load_only and opening.load.running_requests == 0
        await asyncio.wait_for(both_follow(engine), 10.0)
        generate = stub.Generate(pb.GenerateRequest(
            request_id="long", tokenized=pb.TokenizedInput(input_ids=list(range(1, 40))),
            sampling_params=pb.SamplingParams(max_tokens=900, ignore_eos=True)))
        pushes = await asyncio.wait_for(asyncio.gather(*map(first_push, calls)), 10.0)
        for push in pushes:
            assert push.sequence_number == 0 and not push.load.HasField("cache_hit_rate")
        assert engine._events.load_pushes == 1
        # Served as kvswitch_engine_load_pushes_total, what an e2e test waits on.
        (served,) = [line for line in server.metrics.render().decode().splitlines()
                     if line.startswith("kvswitch_engine_load_pushes_total{")]
        assert served.endswith(" 1.0"), served
        assert not generate.done()  # (still streaming: ended with the channel)


async def test_a_push_names_a_queued_prompt_and_withdraws_it_when_cancelled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_events, "HEARTBEAT_SECONDS", 600.0)
    # One request at a time: the second waits in the queue behind the first.
    engine = SimEngine(SimConfig(profile="tiny", time_scale=0.1, mode="echo", max_num_seqs=1,
                                 kv_events_coalesce_seconds=600.0))

    async def withdrawing(call: grpc.aio.UnaryStreamCall) -> common_pb2.KvEventBatch:
        while True:
            batch = await call.read()
            assert batch is not grpc.aio.EOF
            if batch.load.load_only and batch.events:
                return batch

    async def push_naming(call: grpc.aio.UnaryStreamCall,
                          waiting: int) -> common_pb2.KvEventBatch:
        while True:
            batch = await call.read()
            assert batch is not grpc.aio.EOF
            if batch.load.load_only and batch.load.waiting_requests >= waiting:
                return batch

    async with serving(engine) as (_, stub):

        def generate(request_id: str, ids: list[int]) -> grpc.aio.UnaryStreamCall:
            return stub.Generate(pb.GenerateRequest(
                request_id=request_id, tokenized=pb.TokenizedInput(input_ids=ids),
                sampling_params=pb.SamplingParams(max_tokens=900, ignore_eos=True)))

        # The first asks for queued prompts, as an EPP of several does; the second does not.
        calls = [stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
            load_records_before_first_batch=True), metadata=metadata)
            for metadata in (((QUEUED_PROMPTS, "1"),), ())]
        for call in calls:
            await asyncio.wait_for(call.read(), 10.0)
        await asyncio.wait_for(both_follow(engine), 10.0)
        requests = [generate("first", list(range(1, 40)))]
        await asyncio.wait_for(asyncio.gather(*map(first_push, calls)), 10.0)
        requests.append(generate("second", list(range(100, 150))))
        asked, plain = await asyncio.wait_for(
            asyncio.gather(*(push_naming(call, 1) for call in calls)), 10.0)
        (queued,) = asked.events
        block = engine.profile.block_size
        assert queued.stored.ownership == QUEUED_OWNERSHIP and queued.stored.session_id == "second"
        assert [t for b in queued.stored.blocks for t in b.token_ids] == list(
            range(100, 150 - 50 % block))
        assert not plain.events
        # Cancelled while queued: a push withdraws it, to the subscriber that was told of it.
        requests.pop().cancel()
        withdrawal = await asyncio.wait_for(withdrawing(calls[0]), 10.0)
        (event,) = withdrawal.events
        assert event.stored.ownership == WITHDRAWN_OWNERSHIP
        assert event.stored.session_id == "second" and not event.stored.blocks
        assert withdrawal.load.waiting_requests == 0
        assert not requests[0].done()  # (in flight: ended with the channel)


async def test_a_push_that_would_repeat_the_last_record_is_not_sent() -> None:
    engine = FakeEngine()
    records = kv_events.KvEventStream(engine, 0, load_first=True).run(asyncio.Event())

    def publish(item: KvEventBatchData) -> None:
        engine._kv.append(item)
        engine._kv_added.set()

    async def next_record() -> common_pb2.KvEventBatch:
        return await asyncio.wait_for(anext(records), 10.0)

    try:
        opening = await next_record()
        assert opening.load.load_only and opening.load.running_requests == 0
        # A request came and went before its push: the load is the opening record's again, so
        # the stream's next record is the batch published after the push, not the push.
        publish(LOAD_PUSH)
        publish(KvEventBatchData(0, 1.0))
        batch = await next_record()
        assert not batch.load.load_only and batch.sequence_number == 0
        engine.running.add("r1")
        publish(LOAD_PUSH)  # a request is running: the push goes out
        push = await next_record()
        assert push.load.load_only and push.load.running_requests == 1
        publish(LOAD_PUSH)  # nothing moved since that push
        publish(KvEventBatchData(1, 2.0))
        batch = await next_record()
        assert not batch.load.load_only and batch.sequence_number == 1
    finally:
        await records.aclose()


async def test_a_push_carries_queued_prompts_only_to_a_stream_that_asked() -> None:
    engine = FakeEngine()
    block = engine.model.block_size
    asked = kv_events.KvEventStream(engine, 0, load_first=True, queued_prompts=True)
    plain = kv_events.KvEventStream(engine, 0, load_first=True)
    queued = QueuedPrompt("r1", tuple(range(1, 2 * block + 1)))

    async def records(stream: kv_events.KvEventStream) -> list[common_pb2.KvEventBatch]:
        run = stream.run(asyncio.Event())
        try:
            return [await asyncio.wait_for(anext(run), 10.0) for _ in range(3)]
        finally:
            await run.aclose()

    for item in (KvEventBatchData(0, 1.0),
                 KvEventBatchData(-1, 0.0, load_only=True, queued=(queued,)),
                 KvEventBatchData(1, 2.0)):
        engine._kv.append(item)
    engine._kv_added.set()
    _, _, push = await records(asked)
    # The load repeats the batch's, yet the push goes out: it names where r1's blocks go.
    assert push.load.load_only and push.sequence_number == 0
    (event,) = push.events
    assert event.stored.ownership == QUEUED_OWNERSHIP and event.stored.session_id == "r1"
    assert [list(b.token_ids) for b in event.stored.blocks] == [
        list(range(1, block + 1)), list(range(block + 1, 2 * block + 1))]
    assert not event.stored.HasField("parent_block_hash")
    # The other stream skips the push (its load repeats) and sends no queued prompt at all.
    records_plain = await records(plain)
    assert [r.load.load_only for r in records_plain] == [True, False, False]
    assert not any(r.events and r.load.load_only for r in records_plain)


def test_kvswitch_up_passes_the_delay_to_its_engines() -> None:
    import argparse

    from kvswitch.up import add_arguments, engine_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_args(parser.parse_args([])) == ()
    assert engine_args(parser.parse_args(["--load-push-ms", "0"])) == ("--load-push-ms", "0")
