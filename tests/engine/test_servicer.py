"""The servicer over an in-memory engine, through a real grpc.aio server and client on loopback."""

from __future__ import annotations

import asyncio
import io
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvswitch.engine.server import EngineServer, ServerOptions
from kvswitch.protocol import SERVICE_NAME, common_pb2, method_path, vllm_engine_pb2_grpc
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.headers import USAGE_TRAILER
from kvswitch.tokenization import load_tokenizer
from tests.engine.fake_engine import FakeEngine


@dataclass
class Served:
    engine: FakeEngine
    server: EngineServer
    stub: vllm_engine_pb2_grpc.VllmEngineStub
    channel: grpc.aio.Channel


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    engine = FakeEngine(step_seconds=0.001)
    server = EngineServer(engine, load_tokenizer(None), ServerOptions(port=0, http_port=0,
                                                                      grace_period=2.0))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield Served(engine, server, vllm_engine_pb2_grpc.VllmEngineStub(channel), channel)
    await channel.close()
    await server.stop(0)


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateResponse]:
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.append(message)
    return out


def usage(trailers: grpc.aio.Metadata) -> dict[str, int]:
    value = dict(trailers)[USAGE_TRAILER]
    return {k: int(v) for k, v in (item.split("=") for item in value.split(";"))}


async def test_text_generate_non_stream_gives_one_complete(served: Served) -> None:
    call = served.stub.Generate(pb.GenerateRequest(
        request_id="r1", text="Hello", sampling_params=pb.SamplingParams(max_tokens=10)))
    messages = [m async for m in call]
    assert len(messages) == 1
    complete = messages[0].complete
    assert len(complete.output_ids) == 10 and complete.prompt_tokens == 1
    assert complete.finish_reason == "length" and complete.completion_tokens == 10
    assert usage(await call.trailing_metadata()) == {
        "prompt_tokens": 1, "completion_tokens": 10, "cached_tokens": 0}


async def test_stream_n2_sends_indexed_chunks_then_completes(served: Served) -> None:
    call = served.stub.Generate(pb.GenerateRequest(
        request_id="r2", tokenized=pb.TokenizedInput(input_ids=list(range(1, 9))), stream=True,
        sampling_params=pb.SamplingParams(max_tokens=3, n=2, logprobs=2, prompt_logprobs=1)))
    messages = [m async for m in call]
    chunks = [m.chunk for m in messages if m.WhichOneof("response") == "chunk"]
    completes = [m.complete for m in messages if m.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == [0, 1]
    for index in (0, 1):
        mine = [c for c in chunks if c.index == index]
        assert sum(len(c.token_ids) for c in mine) == 3
        assert mine[0].HasField("input_logprobs") and not mine[1].HasField("input_logprobs")
        assert len(mine[0].input_logprobs.token_ids) == 8
        assert len(mine[0].output_logprobs.top_logprobs[0].token_ids) == 2
    assert all(c.cached_tokens == 4 and c.prompt_tokens == 8 for c in chunks)
    # vLLM's DELTA semantics: the complete repeats only the last delta.
    assert all(len(c.output_ids) == 1 and c.finish_reason == "length" for c in completes)
    assert usage(await call.trailing_metadata())["completion_tokens"] == 6


async def test_stop_token_reports_matched_stop(served: Served) -> None:
    messages = [m async for m in served.stub.Generate(pb.GenerateRequest(
        request_id="r3", text="Hi", sampling_params=pb.SamplingParams(
            max_tokens=10, stop_token_ids=[1002], seed=0)))]
    complete = messages[-1].complete
    assert complete.finish_reason == "stop" and complete.matched_token_id == 1002
    assert list(complete.output_ids) == [1000, 1001, 1002]


@pytest.mark.parametrize(("request_fields", "needle"), [
    ({"text": "Hi", "sampling_params": pb.SamplingParams(temperature=-1)}, "temperature"),
    ({"text": ""}, "empty"),
    ({}, "input"),
    ({"text": "Hi", "kv_transfer_params": pb.KvTransferParams(remote_port=3)},
     "kv_transfer_params"),
    ({"tokenized": pb.TokenizedInput(input_ids=[0, 1])}, "refused by the fake"),
])
async def test_bad_requests_are_invalid_argument(served: Served, request_fields: dict[str, object],
                                                 needle: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in served.stub.Generate(pb.GenerateRequest(request_id="bad",
                                                               **request_fields)):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (info.value.details() or "")


ENGINE_METHODS = pb.DESCRIPTOR.services_by_name["VllmEngine"].methods_by_name


def raw(message: bytes) -> bytes:
    return message


async def call_with_bytes(channel: grpc.aio.Channel, method: str, request: bytes) -> None:
    """Sends `request` as it is (no protobuf serialisation) and reads the call to its end."""
    if ENGINE_METHODS[method].server_streaming:
        async for _ in channel.unary_stream(method_path(method), request_serializer=raw,
                                            response_deserializer=raw)(request):
            pass
    else:
        await channel.unary_unary(method_path(method), request_serializer=raw,
                                  response_deserializer=raw)(request)


@pytest.mark.parametrize("method", sorted(ENGINE_METHODS))
async def test_undecodable_request_is_invalid_argument(served: Served, method: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call_with_bytes(served.channel, method, b"not a protobuf message")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be parsed" in (info.value.details() or "")
    # The server goes on serving: a valid Generate right after completes.
    messages = [m async for m in served.stub.Generate(pb.GenerateRequest(
        request_id="after", text="Hi", sampling_params=pb.SamplingParams(max_tokens=3)))]
    assert messages[-1].complete.finish_reason == "length"


async def test_generate_with_bad_utf8_is_invalid_argument(served: Served) -> None:
    # Field 1 (request_id, a string) holding bytes that are not UTF-8.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call_with_bytes(served.channel, "Generate", b"\x0a\x02\xff\xfe")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GenerateRequest" in (info.value.details() or "")
    assert not served.engine.running and served.server.servicer.active_requests == 0


async def test_engine_failure_is_internal(served: Served) -> None:
    served.engine.fail_after = 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in served.stub.Generate(pb.GenerateRequest(request_id="f", text="Hi")):
            pass
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "injected" in (info.value.details() or "")


async def wait_until(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def test_client_cancel_closes_the_engine_request(served: Served) -> None:
    served.engine.step_seconds = 0.05
    call = served.stub.Generate(pb.GenerateRequest(
        request_id="c1", text="Hi", stream=True, sampling_params=pb.SamplingParams(max_tokens=500)))
    await call.read()
    assert "c1" in served.engine.running
    call.cancel()
    await wait_until(lambda: "c1" in served.engine.closed)
    assert "c1" not in served.engine.running


async def test_deadline_closes_the_engine_request(served: Served) -> None:
    served.engine.step_seconds = 0.05
    call = served.stub.Generate(pb.GenerateRequest(
        request_id="d1", text="Hi", stream=True, sampling_params=pb.SamplingParams(max_tokens=500)),
        timeout=0.3)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until(lambda: "d1" in served.engine.closed)


async def test_abort_ends_a_request_and_ignores_unknown_ids(served: Served) -> None:
    served.engine.step_seconds = 0.02
    call = served.stub.Generate(pb.GenerateRequest(
        request_id="a1", text="Hi", stream=True, sampling_params=pb.SamplingParams(max_tokens=500)))
    await call.read()
    await served.stub.Abort(pb.AbortRequest(request_ids=["a1", "nobody"]))
    messages = await read_rest(call)
    assert messages[-1].complete.finish_reason == "abort"


async def test_embed(served: Served) -> None:
    call = served.stub.Embed(pb.EmbedRequest(
        request_id="e", tokenized=pb.TokenizedInput(original_text="Hello", input_ids=[9707, 3])))
    response = await call
    assert response.prompt_tokens == 2 and response.embedding_dim == len(response.embedding) == 7
    assert usage(await call.trailing_metadata())["prompt_tokens"] == 2
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.stub.Embed(pb.EmbedRequest(request_id="e2"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_info_rpcs(served: Served) -> None:
    health = await served.stub.HealthCheck(pb.HealthCheckRequest())
    assert health.healthy and health.message
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.served_model_name == "fake" and list(info.eos_token_ids) == [151645]
    assert info.max_context_length == 256 and info.max_req_input_len == 255
    before = await served.stub.GetServerInfo(pb.GetServerInfoRequest())
    assert before.server_type == "vllm-grpc" and before.last_receive_timestamp == 0.0
    await served.stub.Generate(pb.GenerateRequest(request_id="x", text="Hi")).read()
    after = await served.stub.GetServerInfo(pb.GetServerInfoRequest())
    assert after.last_receive_timestamp > 0 and after.block_size == 4
    assert after.max_num_seqs == 2 and after.data_parallel_size == 1
    loads = await served.stub.GetLoads(pb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].max_running_requests == 2
    assert not (await served.stub.GetLoads(pb.GetLoadsRequest(dp_rank=3))).loads
    assert not (await served.stub.GetLoads(pb.GetLoadsRequest(include=["memory"]))).loads


async def test_more_requests_than_slots_wait(served: Served) -> None:
    served.engine.step_seconds = 0.05
    calls = [served.stub.Generate(pb.GenerateRequest(
        request_id=f"w{i}", text="Hi", stream=True,
        sampling_params=pb.SamplingParams(max_tokens=500))) for i in range(3)]
    await wait_until(lambda: len(served.engine.waiting) == 1)
    load = (await served.stub.GetLoads(pb.GetLoadsRequest())).loads[0]
    assert (load.num_running_reqs, load.num_waiting_reqs, load.num_total_reqs) == (2, 1, 3)
    for call in calls:
        call.cancel()
    await wait_until(lambda: not served.engine.running and not served.engine.waiting)


async def test_get_tokenizer_zip_rebuilds_the_tokenizer(  # type: ignore[no-untyped-def]
        served: Served, tmp_path) -> None:
    import hashlib
    import json

    chunks = [c async for c in served.stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)
    assert load_tokenizer(str(tmp_path)).encode("Hello") == [9707]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] == [151645] and config["max_position_embeddings"] == 256


async def test_kv_events_stream_with_load_records(served: Served) -> None:
    call = served.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
        load_records_before_first_batch=True))
    first = await call.read()
    assert first.sequence_number == 0 and first.load.load_only
    await served.stub.Generate(pb.GenerateRequest(
        request_id="k", tokenized=pb.TokenizedInput(input_ids=list(range(1, 10))))).read()
    batch = await call.read()
    assert batch.sequence_number == 1 and not batch.load.load_only
    blocks = batch.events[0].stored.blocks
    assert [list(b.token_ids) for b in blocks] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert blocks[0].block_size == 4 and batch.load.sample > first.load.sample
    call.cancel()


async def test_flush_and_profile(served: Served) -> None:
    flushed = await served.stub.FlushCache(common_pb2.FlushCacheRequest())
    assert flushed.success and served.engine.flushed
    assert (await served.stub.StartProfile(common_pb2.StartProfileRequest())).success
    assert (await served.stub.StopProfile(common_pb2.StopProfileRequest())).success


async def test_health_service_and_reflection(served: Served) -> None:
    health = health_pb2_grpc.HealthStub(served.channel)
    for service in ("", SERVICE_NAME):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]))
    names = [s.name async for r in replies for s in r.list_services_response.service]
    assert SERVICE_NAME in names and "grpc.health.v1.Health" in names


async def test_metrics_endpoint(served: Served) -> None:
    await served.stub.Generate(pb.GenerateRequest(request_id="m", text="Hi")).read()
    reader, writer = await asyncio.open_connection("127.0.0.1", served.server.http_port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    body = (await reader.read()).decode()
    writer.close()
    assert body.startswith(("HTTP/1.0 200", "HTTP/1.1 200"))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 ('vllm:request_success_total{engine="0",finished_reason="length",'
                  'model_name="fake"}'),
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds",
                 "vllm:cache_config_info{"):
        assert name in body, name


async def test_metrics_server_answers_health_head_and_unknown_paths(served: Served) -> None:
    async def ask(request: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.server.http_port)
        writer.write(request)
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return reply

    health = await ask(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert health.split(b"\r\n", 1)[0].endswith(b"200 OK") and health.endswith(b"ok\n")
    head = await ask(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n", 1)[0] and head.endswith(b"\r\n\r\n")  # no body
    assert b" 404 " in (await ask(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")).split(b"\r\n")[0]
    post = await ask(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert b" 405 " in post.split(b"\r\n")[0]


async def test_stop_drains_then_goes_not_serving(served: Served) -> None:
    served.engine.step_seconds = 0.01
    call = served.stub.Generate(pb.GenerateRequest(
        request_id="s", text="Hi", stream=True, sampling_params=pb.SamplingParams(max_tokens=20)))
    await call.read()
    stopping = asyncio.create_task(served.server.stop())
    messages = await read_rest(call)
    assert messages[-1].complete.finish_reason == "length"
    await stopping
    assert served.server.servicer.draining.is_set()


async def test_metrics_port_in_use_undoes_the_start() -> None:
    import socket

    engine = FakeEngine()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        server = EngineServer(engine, load_tokenizer(None),
                              ServerOptions(port=0, http_port=holder.getsockname()[1]))
        with pytest.raises(OSError, match="cannot bind the /metrics HTTP server"):
            await server.start()
    assert server.port  # gRPC had bound its port, and released it
    with socket.socket() as again:
        again.bind(("127.0.0.1", server.port))
