"""`kvswitch engine` as a real process on loopback, driven by a grpc.aio client.

Two engines per module: a default-profile one (llama3-8b-h100, time scale 20) for API semantics,
and a `tiny` one (4 sequences, 64 KV blocks, slowed to time scale 0.25) where queueing, KV
pressure, cancellation and prefix caching are visible. No assertion depends on wall-clock
timing: latencies are compared in simulated seconds, read from the /metrics histograms.
"""

from __future__ import annotations

import asyncio
import io
import signal
import time
import urllib.request
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvswitch.engine.sim.profiles import get_profile
from kvswitch.protocol import SERVICE_NAME, common_pb2, vllm_engine_pb2_grpc
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.headers import USAGE_TRAILER
from kvswitch.tokenization import load_tokenizer
from tests.support.processes import Process, free_port, kvswitch_argv, running


class Engine:
    def __init__(self, process: Process, port: int, http_port: int):
        self.process, self.port, self.http_port = process, port, http_port
        self.target = f"127.0.0.1:{port}"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def metric(self, name: str) -> float:
        """The value of one unlabelled-by-the-test sample, e.g. `vllm:..._seconds_sum`."""
        return metric_value(self.metrics(), name)

    def health_status(self) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=5) as r:
            return int(r.status)


def metric_value(text: str, name: str) -> float:
    line = next(l for l in text.splitlines() if l.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from _engine(tmp_path_factory.mktemp("engine") / "engine.log", "--time-scale", "20")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from _engine(tmp_path_factory.mktemp("tiny") / "tiny.log", "--profile", "tiny",
                       "--time-scale", "0.25")


def _engine(log: Path, *extra: str) -> Iterator[Engine]:
    port, http_port = free_port(), free_port()
    argv = kvswitch_argv("engine", "--port", str(port), "--http-port", str(http_port),
                         "--grace-period", "5", *extra)
    with running(argv, port, log) as process:
        yield Engine(process, port, http_port)


@pytest.fixture
async def stub(engine: Engine) -> AsyncIterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    async with grpc.aio.insecure_channel(engine.target) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


@pytest.fixture
async def tiny_stub(tiny: Engine) -> AsyncIterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    async with grpc.aio.insecure_channel(tiny.target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        yield stub
        await wait_idle(stub)  # leave the shared engine as the next test expects it


def gen(rid: str, *, text: str | None = None, ids: list[int] | None = None, stream: bool = False,
        **sampling: object) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=rid, stream=stream,
                                 sampling_params=pb.SamplingParams(**sampling))
    if text is not None:
        request.text = text
    if ids is not None:
        request.tokenized.input_ids.extend(ids)
    return request


async def collect(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateResponse]:
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.append(message)
    return out


async def load(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> pb.SchedulerLoad:
    return (await stub.GetLoads(pb.GetLoadsRequest())).loads[0]


async def wait_until(stub: vllm_engine_pb2_grpc.VllmEngineStub,  # type: ignore[no-untyped-def]
                     predicate, timeout: float = 20.0) -> pb.SchedulerLoad:
    deadline = time.monotonic() + timeout
    while True:
        current = await load(stub)
        if predicate(current):
            return current
        assert time.monotonic() < deadline, f"never held; last load: {current}"
        await asyncio.sleep(0.02)


async def wait_idle(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> pb.SchedulerLoad:
    return await wait_until(stub, lambda l: l.num_total_reqs == 0 and l.num_used_tokens == 0)


# ---- the seed examples and Generate semantics -------------------------------------------------

async def test_seed_example_non_stream(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    call = stub.Generate(gen("req-1", text="Hello", max_tokens=10))
    messages = await collect(call)
    assert [m.WhichOneof("response") for m in messages] == ["complete"]
    complete = messages[0].complete
    assert len(complete.output_ids) == 10 and complete.completion_tokens == 10
    assert complete.prompt_tokens == 1 and complete.finish_reason == "length"
    trailer = dict(await call.trailing_metadata())[USAGE_TRAILER]
    assert trailer == "prompt_tokens=1;completion_tokens=10;cached_tokens=0"


async def test_seed_example_stream(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    messages = await collect(stub.Generate(gen("req-2", text="Hello", max_tokens=10,
                                               stream=True)))
    kinds = [m.WhichOneof("response") for m in messages]
    assert kinds[-1] == "complete" and set(kinds[:-1]) == {"chunk"}
    chunks = [m.chunk for m in messages[:-1]]
    assert sum(len(c.token_ids) for c in chunks) == 10
    assert all(c.prompt_tokens == 1 and c.completion_tokens == len(c.token_ids) for c in chunks)
    assert messages[-1].complete.finish_reason == "length"
    assert list(messages[-1].complete.output_ids) == list(chunks[-1].token_ids)


async def test_n_gives_one_complete_per_index(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    messages = await collect(stub.Generate(gen("n3", text="Hello", max_tokens=5, n=3,
                                               stream=True)))
    completes = [m.complete for m in messages if m.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == [0, 1, 2]
    for index in range(3):
        tokens = [t for m in messages if m.WhichOneof("response") == "chunk"
                  and m.chunk.index == index for t in m.chunk.token_ids]
        assert len(tokens) == 5
    plain = await collect(stub.Generate(gen("n2", text="Hello", max_tokens=4, n=2)))
    assert [m.complete.index for m in plain] == [0, 1]


async def test_same_seed_same_tokens(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    runs = [await collect(stub.Generate(gen(f"seed{i}", text="Tell me", max_tokens=12, seed=7)))
            for i in range(2)]
    assert list(runs[0][0].complete.output_ids) == list(runs[1][0].complete.output_ids)


async def test_stop_token_and_stop_string(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    base = (await collect(stub.Generate(gen("s0", text="Go", max_tokens=12, seed=3))))[0]
    ids = list(base.complete.output_ids)
    stopped = (await collect(stub.Generate(gen("s1", text="Go", max_tokens=12, seed=3,
                                               stop_token_ids=[ids[4]]))))[0].complete
    assert stopped.finish_reason == "stop" and stopped.matched_token_id == ids[4]
    assert list(stopped.output_ids) == ids[:ids.index(ids[4]) + 1]
    word = load_tokenizer(None).decode([ids[2]]).strip() or load_tokenizer(None).decode([ids[2]])
    by_text = (await collect(stub.Generate(gen("s2", text="Go", max_tokens=12, seed=3,
                                               stop=[word]))))[0].complete
    assert by_text.finish_reason == "stop" and by_text.matched_stop_str == word
    assert len(by_text.output_ids) <= 3


async def test_logprobs_shapes(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    complete = (await collect(stub.Generate(gen(
        "lp", ids=[1, 2, 3, 4], max_tokens=3, logprobs=2, prompt_logprobs=1))))[0].complete
    assert list(complete.output_logprobs.token_ids) == list(complete.output_ids)
    assert all(len(t.token_ids) == 2 for t in complete.output_logprobs.top_logprobs)
    assert list(complete.input_logprobs.token_ids) == [1, 2, 3, 4]
    assert not complete.input_logprobs.token_logprobs[0].HasField("value")
    assert complete.input_logprobs.token_logprobs[1].HasField("value")


@pytest.mark.parametrize(("sampling", "field"), [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 1.5}, "top_p"),
    ({"min_p": 2.0}, "min_p"), ({"top_k": 10_000_000}, "top_k"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"max_tokens": 2, "min_tokens": 5}, "min_tokens"), ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 50}, "prompt_logprobs"), ({"stop": [""]}, "stop"),
])
async def test_invalid_sampling_is_invalid_argument(stub: vllm_engine_pb2_grpc.VllmEngineStub,
                                                    sampling: dict[str, object],
                                                    field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub.Generate(gen("bad", text="Hi", **sampling)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (info.value.details() or "")


@pytest.mark.parametrize("request_", [
    pb.GenerateRequest(request_id="e1", text=""),
    pb.GenerateRequest(request_id="e2"),
    pb.GenerateRequest(request_id="e3", text="Hi",
                       kv_transfer_params=pb.KvTransferParams(remote_host="h")),
    pb.GenerateRequest(request_id="e4", tokenized=pb.TokenizedInput(input_ids=[10**7])),
])
async def test_invalid_input_is_invalid_argument(stub: vllm_engine_pb2_grpc.VllmEngineStub,
                                                 request_: pb.GenerateRequest) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub.Generate(request_))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- management RPCs --------------------------------------------------------------------------

async def test_embed(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    call = stub.Embed(pb.EmbedRequest(request_id="req-3", tokenized=pb.TokenizedInput(
        original_text="Hello", input_ids=[9906])))
    response = await call
    assert response.prompt_tokens == 1 and response.embedding_dim == 1024
    assert len(response.embedding) == 1024
    assert "prompt_tokens=1" in dict(await call.trailing_metadata())[USAGE_TRAILER]


async def test_model_and_server_info(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    health = await stub.HealthCheck(pb.HealthCheckRequest())
    assert health.healthy
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.served_model_name and info.is_generation and 151645 in info.eos_token_ids
    assert info.max_context_length == 131072 and info.vocab_size >= 151643
    assert info.architectures and info.model_type
    server = await stub.GetServerInfo(pb.GetServerInfoRequest())
    assert server.server_type == "vllm-grpc" and server.block_size == 16
    assert server.max_num_seqs == 1024 and server.data_parallel_size == 1
    assert 0 < server.last_receive_timestamp <= time.time() and server.uptime_seconds > 0


async def test_get_tokenizer_zip_loads(stub: vllm_engine_pb2_grpc.VllmEngineStub,
                                       tmp_path: Path) -> None:
    import hashlib

    chunks = [c async for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)
    bundle = load_tokenizer(str(tmp_path))
    assert bundle.encode("Hello") == [9707] and 151645 in bundle.eos_token_ids


async def test_kv_events_sequence_numbers(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    prompt = list(range(1000, 1040))  # 2 full blocks of 16
    await collect(stub.Generate(gen("kv1", ids=prompt, max_tokens=1)))
    stored: list[common_pb2.KvBlock] = []
    sequences = []
    while len(stored) < 2:
        batch = await asyncio.wait_for(call.read(), 10)
        assert batch.HasField("load")
        if batch.load.load_only:
            continue
        sequences.append(batch.sequence_number)
        stored += [b for e in batch.events if e.WhichOneof("data") == "stored"
                   for b in e.stored.blocks]
    assert [list(b.token_ids) for b in stored[:2]] == [prompt[:16], prompt[16:32]]
    assert sequences == sorted(sequences)
    call.cancel()
    # Resuming from a known sequence number replays from there.
    again = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
        start_sequence_number=sequences[0]))
    first = await asyncio.wait_for(again.read(), 10)
    assert first.sequence_number == sequences[0]
    again.cancel()


async def test_flush_and_profile(stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    response = await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5))
    assert response.success, response.message
    assert (await stub.StartProfile(common_pb2.StartProfileRequest())).success
    assert (await stub.StopProfile(common_pb2.StopProfileRequest())).success


async def test_health_service_and_reflection(engine: Engine) -> None:
    async with grpc.aio.insecure_channel(engine.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]))
        names = [s.name async for r in replies for s in r.list_services_response.service]
    assert SERVICE_NAME in names and "grpc.health.v1.Health" in names
    # grpcurl resolves the service's methods through reflection.
    async with grpc.aio.insecure_channel(engine.target) as channel:
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol=SERVICE_NAME)]))
        files = [f async for r in replies for f in r.file_descriptor_response.file_descriptor_proto]
    assert files and any(b"GenerateRequest" in f for f in files)


async def test_metrics_have_vllm_names(stub: vllm_engine_pb2_grpc.VllmEngineStub,
                                       engine: Engine) -> None:
    await collect(stub.Generate(gen("m1", text="Hello", max_tokens=3, stream=True)))
    text = await asyncio.to_thread(engine.metrics)
    for name in ("vllm:num_requests_running{", "vllm:num_requests_waiting{",
                 "vllm:kv_cache_usage_perc{", "vllm:prefix_cache_queries_total{",
                 "vllm:prefix_cache_hits_total{", "vllm:prompt_tokens_total{",
                 "vllm:generation_tokens_total{", "vllm:num_preemptions_total{",
                 'vllm:request_success_total{engine="0",finished_reason="length"',
                 "vllm:time_to_first_token_seconds_bucket{",
                 "vllm:inter_token_latency_seconds_bucket{",
                 "vllm:e2e_request_latency_seconds_bucket{",
                 "vllm:request_queue_time_seconds_bucket{", "vllm:cache_config_info{"):
        assert name in text, name
    blocks = get_profile("llama3-8b-h100").num_gpu_blocks
    assert f'num_gpu_blocks="{blocks}"' in text and 'model_name="' in text
    # Observed, not just declared (queue time comes from the simulator's first scheduled step).
    for histogram in ("time_to_first_token", "request_queue_time", "e2e_request_latency"):
        assert metric_value(text, f"vllm:{histogram}_seconds_count") >= 1, histogram
    assert await asyncio.to_thread(engine.health_status) == 200


# ---- scheduler behaviour on the tiny profile ----------------------------------------------------

async def test_more_requests_than_seqs_wait(tiny_stub: vllm_engine_pb2_grpc.VllmEngineStub
                                            ) -> None:
    calls = [tiny_stub.Generate(gen(f"q{i}", ids=[100 + i] * 8, max_tokens=200, stream=True))
             for i in range(6)]
    busy = await wait_until(tiny_stub, lambda l: l.num_running_reqs == 4
                            and l.num_waiting_reqs == 2)
    assert busy.num_total_reqs == 6 and busy.max_running_requests == 4
    assert busy.num_used_tokens > 0 and 0 < busy.token_usage <= 1
    for call in calls:
        call.cancel()
    idle = await wait_idle(tiny_stub)
    assert idle.num_total_reqs == 0


async def test_kv_pressure_preempts_yet_all_complete(
        tiny_stub: vllm_engine_pb2_grpc.VllmEngineStub, tiny: Engine) -> None:
    def preemptions(text: str) -> float:
        return metric_value(text, "vllm:num_preemptions_total")

    before = preemptions(await asyncio.to_thread(tiny.metrics))
    # 4 x (200 prompt + 200 output) tokens need 100 blocks of 16; the cache has 64.
    calls = [tiny_stub.Generate(gen(f"p{i}", ids=[2000 + i] * 200, max_tokens=200,
                                    ignore_eos=True)) for i in range(4)]
    results = await asyncio.gather(*(collect(c) for c in calls))
    for messages in results:
        assert len(messages[-1].complete.output_ids) == 200
        assert messages[-1].complete.finish_reason == "length"
    assert preemptions(await asyncio.to_thread(tiny.metrics)) > before


async def test_cancel_frees_the_slot_and_blocks(tiny_stub: vllm_engine_pb2_grpc.VllmEngineStub
                                                ) -> None:
    call = tiny_stub.Generate(gen("c1", ids=list(range(300, 340)), max_tokens=500, stream=True))
    await call.read()
    busy = await load(tiny_stub)
    assert busy.num_running_reqs == 1 and busy.num_used_tokens >= 32
    call.cancel()
    await wait_idle(tiny_stub)


async def test_abort_by_id_frees_and_reports_abort(
        tiny_stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    call = tiny_stub.Generate(gen("ab1", ids=list(range(400, 420)), max_tokens=500,
                                  stream=True))
    await call.read()
    await tiny_stub.Abort(pb.AbortRequest(request_ids=["ab1", "never-seen"]))
    messages = await collect(call)
    assert messages[-1].complete.finish_reason == "abort"
    await wait_idle(tiny_stub)


async def test_deadline_exceeded_frees(tiny_stub: vllm_engine_pb2_grpc.VllmEngineStub) -> None:
    call = tiny_stub.Generate(gen("dl1", ids=list(range(500, 520)), max_tokens=500,
                                  stream=True), timeout=0.5)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_idle(tiny_stub)


async def test_queued_requests_report_simulated_queue_time(
        tiny_stub: vllm_engine_pb2_grpc.VllmEngineStub, tiny: Engine) -> None:
    queue_sum = "vllm:request_queue_time_seconds_sum"
    queue_count = "vllm:request_queue_time_seconds_count"
    ttft_count = "vllm:time_to_first_token_seconds_count"
    before = await asyncio.to_thread(tiny.metrics)
    # Six requests for four sequence slots: two wait until the first four finish.
    await asyncio.gather(*(collect(tiny_stub.Generate(gen(f"qt{i}", ids=[900 + i] * 8,
                                                          max_tokens=200, ignore_eos=True)))
                           for i in range(6)))
    after = await asyncio.to_thread(tiny.metrics)

    def grew(name: str) -> float:
        return metric_value(after, name) - metric_value(before, name)

    assert grew(queue_count) == 6 and grew(ttft_count) == 6
    # The two queued ones waited for 200 steps of >= 1 ms simulated (the tiny profile's base
    # step); half of that leaves room for the calls reaching the engine a little apart.
    assert grew(queue_sum) >= 2 * 100 * 0.001


async def test_repeated_prompt_is_cached_and_starts_sooner(
        tiny_stub: vllm_engine_pb2_grpc.VllmEngineStub, tiny: Engine) -> None:
    prompt = [7000 + (i % 500) for i in range(960)]  # 60 blocks: 15 prefill steps uncached
    ttft_sum = "vllm:time_to_first_token_seconds_sum"

    async def first_token(rid: str) -> tuple[float, int]:
        """(simulated TTFT from the /metrics histogram, cached tokens) of one request alone."""
        await wait_idle(tiny_stub)
        before = await asyncio.to_thread(tiny.metric, ttft_sum)
        messages = await collect(tiny_stub.Generate(gen(rid, ids=prompt, max_tokens=1,
                                                        stream=True)))
        ttft = await asyncio.to_thread(tiny.metric, ttft_sum) - before
        return ttft, messages[0].chunk.cached_tokens

    cold, cold_cached = await first_token("ttft-cold")
    warm, warm_cached = await first_token("ttft-warm")
    assert cold_cached == 0 and warm_cached >= 944
    # Simulated: 15 chunked-prefill steps of >= 1 ms against one; scheduling noise on the
    # test machine only reaches these through the idle clock (x0.25), far below the margin.
    assert cold >= 15 * 0.001 and warm < cold / 5


# ---- shutdown ---------------------------------------------------------------------------------

async def test_sigterm_drains_in_flight_then_exits_zero(tmp_path: Path) -> None:
    port = free_port()
    argv = kvswitch_argv("engine", "--port", str(port), "--profile", "tiny",
                         "--time-scale", "0.5", "--grace-period", "20")
    with running(argv, port, tmp_path / "drain.log") as process:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            # A KV-event subscription never ends by itself: drain must end it, not wait on it.
            kv_events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
                load_records_before_first_batch=True))
            await kv_events.read()
            call = stub.Generate(gen("drain", ids=[5] * 8, max_tokens=60, stream=True))
            first = await call.read()
            process.signal(signal.SIGTERM)
            messages = [first, *await collect(call)]
            assert messages[-1].complete.finish_reason == "length"
            tokens = sum(len(m.chunk.token_ids) for m in messages
                         if m.WhichOneof("response") == "chunk")
            assert tokens == 60
            while (batch := await kv_events.read()) is not grpc.aio.EOF:
                assert batch.HasField("load")
        assert await asyncio.to_thread(process.wait, 10) == 0
        log = process.output()
        assert "Received SIGTERM" in log and "Shutdown complete" in log


def test_metrics_port_in_use_exits_2_cleanly(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        http_port = holder.getsockname()[1]
        argv = kvswitch_argv("engine", "--port", str(port), "--http-port", str(http_port),
                             "--profile", "tiny")
        process = Process(argv, tmp_path / "clash.log")
        try:
            code = process.wait(30)
        except subprocess.TimeoutExpired:
            print(process.output(), file=sys.stderr)
            raise
        finally:
            process.stop()
    log = (tmp_path / "clash.log").read_text()
    assert code == 2, log
    assert f"cannot bind the /metrics HTTP server to 127.0.0.1:{http_port}" in log
    assert "Traceback" not in log and "Exception ignored" not in log
    with socket.socket() as again:  # the gRPC port was released
        again.bind(("127.0.0.1", port))


@pytest.mark.parametrize(("kind", "code"), [("internal", grpc.StatusCode.INTERNAL),
                                            ("unavailable", grpc.StatusCode.UNAVAILABLE)])
async def test_engine_failures_map_to_status_codes(tmp_path: Path, kind: str,
                                                   code: grpc.StatusCode) -> None:
    port = free_port()
    argv = kvswitch_argv("engine", "--port", str(port), "--profile", "tiny", "--time-scale",
                         "100", "--failure-rate", "1", "--failure-kind", kind)
    with running(argv, port, tmp_path / f"{kind}.log"):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub.Generate(gen("boom", text="Hi", max_tokens=4)))
            assert info.value.code() == code
            assert (await stub.HealthCheck(pb.HealthCheckRequest())).healthy
