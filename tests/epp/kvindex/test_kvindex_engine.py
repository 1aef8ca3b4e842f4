"""The KV-event subscriber against a real `kvswitch engine` subprocess on loopback."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvswitch.epp.kvindex import KvBlockIndex, KvEventSubscriber
from kvswitch.protocol import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc
from tests.support.processes import free_port, kvswitch_argv, running
from tests.support.waiting import until

PROMPT = tuple(range(1000, 1070))  # 70 tokens: 4 full blocks of 16


def engine_argv(port: int) -> list[str]:
    return kvswitch_argv("engine", "--port", str(port), "--profile", "tiny",
                         "--time-scale", "20", "--mode", "random", "--seed", "1")


async def generate(address: str, prompt: tuple[int, ...], request_id: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        request = vllm_engine_pb2.GenerateRequest(
            request_id=request_id, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
            sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2), stream=False)
        async for _ in stub.Generate(request, timeout=10):
            pass


async def flush(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        reply = await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5), timeout=10)
        assert reply.success, reply.message



@pytest.mark.timeout(60)
async def test_subscriber_follows_a_real_engine(tmp_path: Path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    index = KvBlockIndex(16)
    with running(engine_argv(port), port, tmp_path / "engine.log"):
        await generate(address, PROMPT, "before-subscribing")
        subscriber = KvEventSubscriber(address, index)
        await subscriber.start()
        try:
            # The engine replays its history: blocks stored before we subscribed are known.
            await until(lambda: index.match_tokens(PROMPT)[address] == 64)
            assert not subscriber.tracker.partial
            await until(lambda: subscriber.load is not None)
            other = tuple(range(5000, 5040))  # 2 full blocks
            await generate(address, other, "second")
            await until(lambda: index.match_tokens(other)[address] == 32)
            await flush(address)
            await until(lambda: index.num_blocks(address) == 0)
            assert index.match_tokens(PROMPT)[address] == 0
            # A dropped stream resumes where it stopped, without losing batches.
            await subscriber.stop()
            last = subscriber.tracker.last
            await generate(address, PROMPT, "while-disconnected")
            await subscriber.start()
            await until(lambda: index.match_tokens(PROMPT)[address] == 64)
            assert subscriber.tracker.last is not None and last is not None
            assert subscriber.tracker.last > last and subscriber.tracker.resets == 0
        finally:
            await subscriber.stop()

    # The engine restarts on the same port: numbering starts over, so the index is rebuilt.
    with running(engine_argv(port), port, tmp_path / "engine2.log"):
        subscriber.engine_started_at = (subscriber.engine_started_at or 0) - 60  # an older life
        await subscriber.start()
        try:
            await until(lambda: subscriber.streams_opened >= 2)
            await until(lambda: index.num_blocks(address) == 0)
            fresh = tuple(range(7000, 7050))
            await generate(address, fresh, "after-restart")
            await until(lambda: index.match_tokens(fresh)[address] == 48)
        finally:
            await subscriber.stop()
