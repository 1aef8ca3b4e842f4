"""The EPP's telemetry over SGLang's API, against a real `kvswitch engine --api sglang` process:
the KV-event subscriber regroups its radix-cache pages (page size 1 and 4) into the index's
16-token blocks, and the gRPC collector reads its load reports; the pool file names the API."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvswitch.epp.config import load_documents, parse_pool
from kvswitch.epp.datalayer import GrpcCollector
from kvswitch.epp.datalayer.endpoint import H2C, EndpointSpec
from kvswitch.epp.framework import ConfigError
from kvswitch.epp.kvindex import KvBlockIndex, KvEventSubscriber
from kvswitch.protocol import common_pb2
from kvswitch.protocol.sglang import sglang_scheduler_pb2 as pb
from kvswitch.protocol.sglang import sglang_scheduler_pb2_grpc as rpc
from tests.support.processes import free_port, kvswitch_argv, running
from tests.support.waiting import until

PROMPT = tuple(range(1000, 1070))  # 70 tokens: 4 full blocks of 16


async def generate(address: str, prompt: tuple[int, ...], request_id: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        request = pb.GenerateRequest(
            request_id=request_id, tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=pb.SamplingParams(max_new_tokens=2, temperature=1.0, top_p=1.0))
        async for _ in rpc.SglangSchedulerStub(channel).Generate(request, timeout=10):
            pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("page_size", [1, 4])
async def test_pages_become_index_blocks_and_loads_are_read(tmp_path: Path,
                                                            page_size: int) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    argv = kvswitch_argv("engine", "--api", "sglang", "--page-size", str(page_size),
                         "--port", str(port), "--profile", "tiny", "--time-scale", "20")
    index = KvBlockIndex(16)
    with running(argv, port, tmp_path / "engine.log"):
        await generate(address, PROMPT, "before-subscribing")
        subscriber = KvEventSubscriber(address, index, api="sglang")
        await subscriber.start()
        collector = GrpcCollector(address, api="sglang")
        try:
            await until(lambda: index.match_tokens(PROMPT)[address] == 64)
            assert subscriber.pages is not None and len(subscriber.pages) >= 64 // page_size
            await until(lambda: subscriber.load is not None)
            metrics = await collector.collect(0.0)
            assert metrics.max_tokens == 64 * 16 and metrics.block_size == page_size
            other = tuple(range(5000, 5040))  # 2 full blocks
            await generate(address, other, "second")
            await until(lambda: index.match_tokens(other)[address] == 32)
            async with grpc.aio.insecure_channel(address) as channel:
                flushed = await rpc.SglangSchedulerStub(channel).FlushCache(
                    common_pb2.FlushCacheRequest(timeout_s=5), timeout=10)
            assert flushed.success
            await until(lambda: index.num_blocks(address) == 0)
            assert len(subscriber.pages) == 0
        finally:
            await subscriber.stop()
            await collector.close()


POOL = """\
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata:
  name: p
  annotations: {kvswitch.dev/engine-api: %s}
spec:
  targetPorts: [{number: 8000, appProtocol: kubernetes.io/h2c}]
---
apiVersion: kvswitch.dev/v1alpha1
kind: EndpointList
endpoints: ["10.0.0.1"]
"""


def test_the_inference_pool_names_its_engine_api() -> None:
    pool = parse_pool(load_documents(POOL % "sglang", "pool"))
    assert pool.api == "sglang"
    assert pool.endpoints == (EndpointSpec("10.0.0.1:8000", H2C, "sglang"),)
    plain = parse_pool(load_documents(POOL.replace("  annotations: {kvswitch.dev/engine-api: %s}\n",
                                                   ""), "pool"))
    assert plain.api == "vllm" and plain.endpoints[0].api == "vllm"
    with pytest.raises(ConfigError, match=r"annotations\[kvswitch.dev/engine-api\]: expected"):
        parse_pool(load_documents(POOL % "trtllm", "pool"))
