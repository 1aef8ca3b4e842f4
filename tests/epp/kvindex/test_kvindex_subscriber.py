"""The KV-event subscriber's stream handling against a scripted grpc.aio engine on loopback:
batches applied as they arrive, a gap resubscribes at once, a failing handler is logged and
recovered from."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc.aio
import pytest

from kvswitch.epp.kvindex import KvBlockIndex, KvEventSubscriber, LoadRecord
from kvswitch.protocol import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc
from tests.support.waiting import until


def tokens(n: int) -> list[int]:
    return list(range(n * 16, (n + 1) * 16))


def stored_batch(n: int) -> common_pb2.KvEventBatch:
    """Batch `n` stores one root block of `tokens(n)` (engine hash 100 + n) and a load record."""
    block = common_pb2.KvBlock(block_hash=100 + n, block_size=16, token_ids=tokens(n))
    event = common_pb2.KvCacheEvent(stored=common_pb2.KvBlocksStored(blocks=[block]))
    return common_pb2.KvEventBatch(sequence_number=n, events=[event],
                                   load=common_pb2.EngineLoad(running_requests=n, sample=n))


class _Engine(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Each SubscribeKvEvents call streams the next script's batch numbers, then stays open."""

    def __init__(self, scripts: list[list[int]]) -> None:
        self.scripts = scripts
        self.starts: list[int] = []

    async def GetServerInfo(self, request, context):  # type: ignore[no-untyped-def]
        return vllm_engine_pb2.GetServerInfoResponse(block_size=16, uptime_seconds=10.0)

    async def SubscribeKvEvents(self, request, context):  # type: ignore[no-untyped-def]
        self.starts.append(request.start_sequence_number)
        script = self.scripts[len(self.starts) - 1] if len(self.starts) <= len(self.scripts) else []
        for n in script:
            yield stored_batch(n)
        await asyncio.sleep(3600)


Serve = Callable[[list[list[int]]], Awaitable[tuple[_Engine, str]]]


@pytest.fixture()
async def serve() -> AsyncIterator[Serve]:
    servers: list[grpc.aio.Server] = []

    async def start(scripts: list[list[int]]) -> tuple[_Engine, str]:
        engine = _Engine(scripts)
        server = grpc.aio.server()
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(engine, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return engine, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(0)



async def test_a_gap_resubscribes_at_once_from_the_missing_batch(serve: Serve) -> None:
    engine, address = await serve([[0, 1, 3, 4], [2, 3, 4, 5]])
    index = KvBlockIndex(16)
    loads: list[LoadRecord] = []
    subscriber = KvEventSubscriber(address, index, on_load=lambda _, load: loads.append(load),
                                   retry_delay=30.0)  # a backoff would show as a timeout
    await subscriber.start()
    try:
        await until(lambda: subscriber.tracker.last == 5)
        assert engine.starts == [0, 2]
        assert subscriber.tracker.gaps == 1 and subscriber.streams_opened == 2
        assert subscriber.connected and not subscriber.tracker.partial
        for n in range(6):
            assert index.match_tokens(tokens(n))[address] == 16
        assert subscriber.load is not None and subscriber.load.sample == 5
        # The first stream stopped at batch 3 (its load record counts; batch 4 never came).
        assert [load.sample for load in loads] == [0, 1, 3, 2, 3, 4, 5]
    finally:
        await subscriber.stop()


async def test_a_failing_handler_is_logged_clears_the_index_and_resubscribes(
        serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    # The second stream does not replay batch 0: its block must be gone with the cleared index.
    engine, address = await serve([[0, 1, 2], [1, 2, 3]])
    index = KvBlockIndex(16)
    failures = [RuntimeError("load consumer bug")]

    def on_load(_: str, load: LoadRecord) -> None:
        if load.sample == 2 and failures:
            raise failures.pop()

    subscriber = KvEventSubscriber(address, index, on_load=on_load, retry_delay=0.05)
    await subscriber.start()
    try:
        await until(lambda: subscriber.tracker.last == 3)
        # Not swallowed: logged with its traceback ...
        errors = [r for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "applying a batch failed" in errors[0].getMessage()
        assert errors[0].exc_info is not None
        assert "load consumer bug" in str(errors[0].exc_info[1])
        # ... and recovered from: the index was cleared and a fresh subscription (from
        # sequence 0) rebuilt it.
        assert engine.starts == [0, 0]
        assert index.match_tokens(tokens(0)).get(address, 0) == 0
        for n in range(1, 4):
            assert index.match_tokens(tokens(n))[address] == 16
        assert subscriber.connected and not subscriber._task.done()  # type: ignore[union-attr]
    finally:
        await subscriber.stop()
