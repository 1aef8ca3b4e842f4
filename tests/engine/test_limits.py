"""Hostile requests at the engine: counts over `SamplingLimits`, max_tokens past the model,
truncated gRPC frames and gzip bombs each end their call with a clear status at once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from kvswitch.engine.server import EngineServer, ServerOptions
from kvswitch.engine.sim import SimConfig, SimEngine
from kvswitch.limits import MessageLimits, SamplingLimits
from kvswitch.protocol import GENERATE_PATH, vllm_engine_pb2_grpc
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.tokenization import load_tokenizer
from tests.support import raw_grpc


@dataclass
class Served:
    port: int
    stub: vllm_engine_pb2_grpc.VllmEngineStub


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    engine = SimEngine(SimConfig(profile="tiny", time_scale=100))
    server = EngineServer(engine, load_tokenizer(None), ServerOptions(
        port=0, grace_period=0, sampling_limits=SamplingLimits(max_n=4, max_stop=3),
        message_limits=MessageLimits(max_message_bytes=1024 * 1024)))
    port = await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield Served(port, vllm_engine_pb2_grpc.VllmEngineStub(channel))
    await server.stop(0)


async def generate(served: Served, **sampling: object) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(request_id="r", text="hello",
                                 sampling_params=pb.SamplingParams(**sampling))
    return [m async for m in served.stub.Generate(request, timeout=10)]


async def test_within_the_limits_is_served(served: Served) -> None:
    messages = await generate(served, max_tokens=2, n=4, stop=["a", "b", "c"])
    assert sorted(m.complete.index for m in messages) == [0, 1, 2, 3]


@pytest.mark.parametrize(("sampling", "param"), [
    ({"n": 5}, "n"),
    ({"n": 10**9}, "n"),
    ({"stop": ["a", "b", "c", "d"]}, "stop"),
    ({"stop": ["x" * 1025]}, "stop"),
    ({"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ({"max_tokens": 2**31}, "max_tokens"),
])
async def test_counts_over_the_limits_are_invalid_argument(
        served: Served, sampling: dict[str, object], param: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(served, **sampling)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert param in caught.value.details() and "limit" in caught.value.details()


@pytest.mark.parametrize("sampling", [{"max_tokens": 5000}, {"min_tokens": 5000}])
async def test_max_tokens_past_the_model_is_invalid_argument_not_unknown(
        served: Served, sampling: dict[str, object]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(served, **sampling)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "maximum context length is 1024" in caught.value.details()


def request_bytes() -> bytes:
    return pb.GenerateRequest(request_id="r", text="hi",
                              sampling_params=pb.SamplingParams(max_tokens=1)).SerializeToString()


async def test_whole_raw_request_is_served(served: Served) -> None:
    status, _ = await raw_grpc.call(served.port, GENERATE_PATH,
                                    raw_grpc.grpc_frame(request_bytes()))
    assert status == grpc.StatusCode.OK.value[0]


@pytest.mark.parametrize("body", [
    raw_grpc.grpc_frame(request_bytes(), declared=len(request_bytes()) + 10),
    raw_grpc.grpc_frame(b"", declared=1000),
    b"\x00\x00",
])
async def test_a_frame_longer_than_its_body_is_answered(served: Served, body: bytes) -> None:
    status, message = await raw_grpc.call(served.port, GENERATE_PATH, body, timeout=5)
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "no whole message" in message


async def test_a_gzip_bomb_is_refused_past_the_message_limit(served: Served) -> None:
    # 8 MiB of text inflated from ~8 KB: past the 1 MiB limit once decompressed.
    size = 8 * 1024 * 1024
    head = pb.GenerateRequest(request_id="bomb").SerializeToString()
    text_tag = bytes([(pb.GenerateRequest.DESCRIPTOR.fields_by_name["text"].number << 3) | 2])
    length = bytearray()
    n = size
    while n >= 128:
        length.append(n & 0x7F | 0x80)
        n >>= 7
    length.append(n)
    bomb = raw_grpc.gzip_bytes(head + text_tag + bytes(length), b"a" * 65536,
                               repeat_last=size // 65536)
    assert len(bomb) < 64 * 1024
    status, message = await raw_grpc.call(
        served.port, GENERATE_PATH, raw_grpc.grpc_frame(bomb, compressed=True),
        headers=[("grpc-encoding", "gzip")])
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message


async def test_a_long_text_prompt_is_tokenized_and_checked(served: Served) -> None:
    # Past the inline limit: tokenized in a worker thread, then held to max_model_len.
    request = pb.GenerateRequest(request_id="long", text="hello " * 4000,
                                 sampling_params=pb.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [m async for m in served.stub.Generate(request, timeout=30)]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "longer than the maximum model length" in caught.value.details()
    short = pb.GenerateRequest(request_id="short", text="hello " * 100,
                               sampling_params=pb.SamplingParams(max_tokens=1))
    messages = [m async for m in served.stub.Generate(short, timeout=30)]
    assert messages[-1].complete.prompt_tokens == 101  # "hello" then " hello" x 99, " "
