"""The data layer against real servers on loopback: a grpc.aio VllmEngine servicer (GetLoads,
GetServerInfo, HealthCheck) and an asyncio HTTP server serving vLLM's /metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from kvswitch.epp.datalayer import (
    H2C,
    HTTP,
    CollectorError,
    Datalayer,
    EndpointSpec,
    GrpcCollector,
    PrometheusCollector,
    Refresher,
    StaticDiscovery,
    parse_prometheus,
)
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol import vllm_engine_pb2_grpc as pb_grpc


class FakeEngine(pb_grpc.VllmEngineServicer):
    def __init__(self) -> None:
        self.running, self.waiting, self.used, self.capacity = 3, 2, 250, 1000
        self.healthy = True
        self.fail_loads = False

    async def HealthCheck(self, request, context):  # type: ignore[no-untyped-def]
        return pb.HealthCheckResponse(healthy=self.healthy, message="ok" if self.healthy else "x")

    async def GetServerInfo(self, request, context):  # type: ignore[no-untyped-def]
        return pb.GetServerInfoResponse(server_type="vllm-grpc", block_size=16)

    async def GetLoads(self, request, context):  # type: ignore[no-untyped-def]
        if self.fail_loads:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        load = pb.SchedulerLoad(num_running_reqs=self.running, num_waiting_reqs=self.waiting,
                                num_used_tokens=self.used, max_total_num_tokens=self.capacity)
        return pb.GetLoadsResponse(dp_rank_count=1, loads=[load])


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    server = grpc.aio.server()
    servicer = FakeEngine()
    pb_grpc.add_VllmEngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(None)


METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen3"} 4.0
vllm:num_requests_waiting{engine="0",model_name="qwen3"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="qwen3"} 0.5
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048"} 1.0
"""


@pytest.fixture
async def metrics_server() -> AsyncIterator[tuple[dict[str, object], str]]:
    state: dict[str, object] = {"body": METRICS, "status": "200 OK"}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = str(state["body"]).encode()
        writer.write(f"HTTP/1.1 {state['status']}\r\nContent-Type: text/plain\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield state, f"127.0.0.1:{port}"
    server.close()
    await server.wait_closed()


async def test_grpc_collector_reads_loads_and_block_size(engine: tuple[FakeEngine, str]) -> None:
    _, address = engine
    collector = GrpcCollector(address)
    metrics = await collector.collect(12.0)
    assert (metrics.running, metrics.waiting, metrics.max_tokens, metrics.block_size) == (
        3, 2, 1000, 16)
    assert metrics.kv_usage == pytest.approx(0.25) and metrics.updated_at == 12.0
    await collector.close()


async def test_grpc_collector_fails_on_unhealthy_engine(engine: tuple[FakeEngine, str]) -> None:
    servicer, address = engine
    servicer.healthy = False
    collector = GrpcCollector(address)
    with pytest.raises(CollectorError, match="unhealthy"):
        await collector.collect(0.0)
    await collector.close()


async def test_prometheus_collector_reads_vllm_metrics(
        metrics_server: tuple[dict[str, object], str]) -> None:
    state, address = metrics_server
    metrics = await PrometheusCollector(address).collect(5.0)
    assert (metrics.running, metrics.waiting, metrics.kv_usage) == (4, 7, 0.5)
    assert (metrics.block_size, metrics.max_tokens) == (16, 16 * 2048)
    state["status"] = "500 Internal Server Error"
    with pytest.raises(CollectorError):
        await PrometheusCollector(address).collect(5.0)


def test_prometheus_parser_reads_label_values_with_commas_and_quotes() -> None:
    text = ('vllm:num_requests_running{model_name="a,b=\\"c\\""} 2.0\n'
            'vllm:cache_config_info{block_size="16",cache_dtype="x,block_size=99",'
            'num_gpu_blocks="10"} 1.0\n')
    metrics = parse_prometheus(text, 0.0)
    assert (metrics.running, metrics.block_size, metrics.max_tokens) == (2, 16, 160)


def test_prometheus_parser_sums_models_and_rejects_non_vllm() -> None:
    text = METRICS + 'vllm:num_requests_running{engine="0",model_name="lora"} 1.0\n'
    assert parse_prometheus(text, 0.0).running == 5
    with pytest.raises(CollectorError):
        parse_prometheus("up 1\n", 0.0)


async def wait_until(predicate, timeout: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_refresher_tracks_both_protocols_and_stale_endpoints_come_back(
        engine: tuple[FakeEngine, str], metrics_server: tuple[dict[str, object], str]) -> None:
    servicer, grpc_address = engine
    _, http_address = metrics_server
    datalayer = Datalayer(staleness=0.1)
    refresher = Refresher(datalayer, StaticDiscovery([EndpointSpec(grpc_address, H2C),
                                                      EndpointSpec(http_address, HTTP)]),
                          interval=0.02)
    await refresher.start()
    try:
        def ready() -> set[str]:
            return {e.address for e in datalayer.ready()}

        await wait_until(lambda: ready() == {grpc_address, http_address})
        servicer.waiting = 9
        await wait_until(
            lambda: datalayer.get(grpc_address).metrics.waiting == 9)  # type: ignore[union-attr]
        # A failing endpoint leaves the ready set, and returns once it answers again.
        servicer.fail_loads = True
        await wait_until(lambda: ready() == {http_address})
        servicer.fail_loads = False
        await wait_until(lambda: ready() == {grpc_address, http_address})
    finally:
        await refresher.stop()


def test_stale_endpoint_is_not_ready_until_refreshed() -> None:
    now = [100.0]
    datalayer = Datalayer(staleness=0.2, clock=lambda: now[0])
    datalayer.set_endpoints([EndpointSpec("a:1"), EndpointSpec("b:1")])
    assert datalayer.ready() == []  # never refreshed
    from kvswitch.epp.datalayer import Metrics

    datalayer.update("a:1", Metrics(updated_at=100.0))
    datalayer.update("b:1", Metrics(updated_at=100.0))
    now[0] = 100.15
    datalayer.update("b:1", Metrics(updated_at=100.15))
    now[0] = 100.3
    assert [e.address for e in datalayer.ready()] == ["b:1"]
    datalayer.update("a:1", Metrics(updated_at=100.3))
    assert [e.address for e in datalayer.ready()] == ["a:1", "b:1"]


def test_pushed_load_updates_metrics_and_stays_fresh_while_records_flow() -> None:
    from kvswitch.epp.datalayer import Metrics

    now = [100.0]
    datalayer = Datalayer(staleness=0.2, clock=lambda: now[0])
    datalayer.set_endpoints([EndpointSpec("a:1")])
    datalayer.update("a:1", Metrics(max_tokens=4096, block_size=16, updated_at=100.0))
    datalayer.push("a:1", running=4, waiting=7, kv_usage=0.5, waiting_tokens=900, ttl=2.5)
    m = datalayer.get("a:1").metrics  # type: ignore[union-attr]
    assert (m.running, m.waiting, m.kv_usage, m.waiting_tokens) == (4, 7, 0.5, 900)
    assert (m.max_tokens, m.block_size) == (4096, 16)  # capacity facts come from polling
    assert m.updated_at == 100.0
    now[0] = 102.0  # quiet engine: no new record, but the stream is live (heartbeats)
    assert [e.address for e in datalayer.ready()] == ["a:1"]
    now[0] = 102.6  # records stopped: stale like any unrefreshed endpoint
    assert datalayer.ready() == []
    datalayer.mark_failed("a:1")
    datalayer.push("a:1", running=0, waiting=0, kv_usage=0.0, waiting_tokens=None, ttl=2.5)
    assert datalayer.ready() == []  # pushes never override a failed health check


def test_pushed_load_clamps_kv_usage_and_keeps_unknown_waiting_tokens() -> None:
    from kvswitch.epp.datalayer import Metrics

    datalayer = Datalayer(clock=lambda: 5.0)
    datalayer.set_endpoints([EndpointSpec("a:1")])
    datalayer.update("a:1", Metrics(waiting_tokens=300))
    for pushed, kept in [(1.5, 1.0), (-0.2, 0.0), (0.0, 0.0), (1.0, 1.0), (0.25, 0.25)]:
        datalayer.push("a:1", running=1, waiting=2, kv_usage=pushed, waiting_tokens=None,
                       ttl=1.0)
        m = datalayer.get("a:1").metrics  # type: ignore[union-attr]
        assert (m.kv_usage, m.waiting_tokens, m.updated_at) == (kept, 300, 5.0)
    datalayer.push("a:1", running=1, waiting=2, kv_usage=float("nan"), waiting_tokens=7, ttl=1.0)
    m = datalayer.get("a:1").metrics  # type: ignore[union-attr]
    assert m.kv_usage != m.kv_usage and m.waiting_tokens == 7  # NaN passes through, as before


class CountingCollector:
    def __init__(self) -> None:
        self.calls = 0

    async def collect(self, now: float):  # type: ignore[no-untyped-def]
        from kvswitch.epp.datalayer import Metrics

        self.calls += 1
        return Metrics(updated_at=now)

    async def close(self) -> None:
        return None


@pytest.mark.parametrize("pushed", [False, True])
async def test_refresher_polls_rarely_while_load_is_pushed(pushed: bool) -> None:
    datalayer = Datalayer()
    collector = CountingCollector()
    refresher = Refresher(datalayer, StaticDiscovery([EndpointSpec("a:1", H2C)]), interval=0.0,
                          collector_factory=lambda spec, _: collector, push_poll_interval=1e9)
    await refresher.start()
    try:
        if pushed:
            datalayer.push("a:1", running=1, waiting=0, kv_usage=0.1, waiting_tokens=0,
                           ttl=1e9)
        before = collector.calls
        for _ in range(50):
            await asyncio.sleep(0)
    finally:
        await refresher.stop()
    # Pushed (and polled once within push_poll_interval): no more polls; else one per turn.
    assert (collector.calls == before) if pushed else (collector.calls > before + 10)


async def test_an_engine_that_drops_its_connection_leaves_the_ready_set_at_once() -> None:
    """Pushed load keeps an endpoint fresh with rare polls; when the engine goes away its
    collector's connection drops and the endpoint is re-checked (and failed) at once, then comes
    back as soon as it answers again."""
    servicer = FakeEngine()

    async def serve(port: int = 0) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        pb_grpc.add_VllmEngineServicer_to_server(servicer, server)
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server, port

    server, port = await serve()
    address = f"127.0.0.1:{port}"
    datalayer = Datalayer(staleness=0.1)
    refresher = Refresher(datalayer, StaticDiscovery([EndpointSpec(address, H2C)]),
                          interval=0.02, push_poll_interval=60.0)
    await refresher.start()
    try:
        def ready() -> bool:
            return [e.address for e in datalayer.ready()] == [address]

        await wait_until(ready)
        datalayer.push(address, running=1, waiting=0, kv_usage=0.1, waiting_tokens=0, ttl=60.0)
        polls = refresher.polls
        await asyncio.sleep(0.2)
        assert refresher.polls <= polls + 1  # pushed: no polling for a minute
        await server.stop(None)
        stopped = time.monotonic()
        await wait_until(lambda: not ready(), timeout=1.0)
        assert time.monotonic() - stopped < 0.5
        server, _ = await serve(port)
        await wait_until(ready)
    finally:
        await refresher.stop()
        await server.stop(None)
