"""An SGLang pool through the real gateway: Envoy → EPP (ext_proc) → `kvswitch engine --api
sglang` replicas whose radix caches publish pages of one token, and the OpenAI frontend."""

from __future__ import annotations

import copy
import http.client
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvswitch.launcher import DEFAULT_EPP_CONFIG
from kvswitch.protocol.headers import FAIRNESS_ID
from kvswitch.protocol.sglang import sglang_scheduler_pb2 as pb
from kvswitch.protocol.sglang import sglang_scheduler_pb2_grpc as rpc
from kvswitch.tokenization import load_tokenizer
from tests.support.gateway import BLOCK, CALL_TIMEOUT, Gateway, epp_samples, prompt, running_gateway

TENANT = [(FAIRNESS_ID, "tenant-sglang")]


def _epp_config() -> dict[str, Any]:
    """Routing by the precise prefix index alone, without speculative indexing: where a prompt
    goes depends only on the KV events the engines published (no load scorer to outweigh it)."""
    config: dict[str, Any] = copy.deepcopy(DEFAULT_EPP_CONFIG)
    config["plugins"] = [p for p in config["plugins"]
                         if p["type"].endswith("-parser") or p["type"] == "max-score-picker"]
    config["plugins"].append({"name": "prefix", "type": "precise-prefix-cache-scorer",
                              "parameters": {"blockSize": BLOCK, "speculativeTtl": 0}})
    config["schedulingProfiles"] = [{"name": "default", "plugins": [
        {"pluginRef": "prefix", "weight": 1}, {"pluginRef": "max-score-picker"}]}]
    return config


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(tmp_path_factory.mktemp("sglang-gateway"), replicas=3, profile="tiny",
                         time_scale=100.0, mode="echo", grace_period=1.0, api="sglang",
                         engine_args=("--page-size", "1"), frontend_workers=1,
                         epp_config=_epp_config()) as gw:
        yield gw


def request(ids: Sequence[int], *, max_new_tokens: int = 8, stream: bool = False
            ) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"sg-{ids[0]}-{len(ids)}-{time.monotonic_ns()}", stream=stream,
        tokenized=pb.TokenizedInput(input_ids=list(ids)),
        sampling_params=pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True,
                                          temperature=1.0, top_p=1.0))


def generate(stub: rpc.SglangSchedulerStub, ids: Sequence[int], **kw: object
             ) -> pb.GenerateComplete:
    responses = list(stub.Generate(request(ids, **kw), metadata=TENANT,  # type: ignore[arg-type]
                                   timeout=CALL_TIMEOUT))
    assert len(responses) == 1 and responses[0].HasField("complete"), responses
    return responses[0].complete


def stub(gateway: Gateway) -> rpc.SglangSchedulerStub:
    return rpc.SglangSchedulerStub(gateway.channel)


def cached_on(gateway: Gateway, ids: Sequence[int]) -> list[str]:
    """The engines whose prefix cache holds `ids`' first block (asked directly)."""
    holders = []
    for address in gateway.engines:
        with grpc.insecure_channel(address) as channel:
            done = generate(rpc.SglangSchedulerStub(channel), [*ids[:BLOCK], 7], max_new_tokens=1)
        if done.cached_tokens >= BLOCK:
            holders.append(address)
    return holders


def test_unary_streamed_and_embed(gateway: Gateway) -> None:
    ids = prompt(1)
    done = generate(stub(gateway), ids)
    assert (done.completion_tokens, done.prompt_tokens, done.finish_reason) == (8, 64, "length")
    assert list(done.output_ids) == ids[:8]  # echo
    responses = list(stub(gateway).Generate(request(prompt(2), max_new_tokens=16, stream=True),
                                            metadata=TENANT, timeout=CALL_TIMEOUT))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    assert responses[-1].HasField("complete") and chunks[-1].completion_tokens == 16
    assert sum(len(c.token_ids) for c in chunks) == 16
    embedded = stub(gateway).Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(
        input_ids=prompt(3))), metadata=TENANT, timeout=CALL_TIMEOUT)
    assert embedded.prompt_tokens == 64 and len(embedded.embedding) == embedded.embedding_dim


def routed_to(gateway: Gateway, tokenized: pb.TokenizedInput) -> str:
    """The endpoint the EPP picks for this prompt, asked with an Embed (which caches nothing,
    so probing does not spread the prefix) under a tenant of its own."""
    tenant = f"probe-{uuid.uuid4().hex[:12]}"
    stub(gateway).Embed(pb.EmbedRequest(tokenized=tokenized), metadata=[(FAIRNESS_ID, tenant)],
                        timeout=CALL_TIMEOUT)
    return endpoint_of(gateway, tenant)


def endpoint_of(gateway: Gateway, tenant: str) -> str:
    """Where the EPP routed the one request of `tenant` (its per-endpoint routing counter)."""
    url = f"http://127.0.0.1:{gateway.launched.ports.epp_metrics[0]}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    (endpoint,) = {s.labels["endpoint"] for family in text_string_to_metric_families(text)
                   for s in family.samples if s.name == "kvswitch_epp_requests_total"
                   and s.labels.get("fairness_id") == tenant and s.value > 0}
    return endpoint


def assert_follows_its_cache(gateway: Gateway, tokenized: pb.TokenizedInput,
                             holder: str) -> None:
    """Once the holder's KV events reach the EPP, the prompt is routed there, every time."""
    deadline = time.monotonic() + 10
    # Until the events arrive every replica scores 0 and a probe lands on the holder 1 time in
    # 3, so one probe there says little: the EPP has learnt once three in a row land there.
    streak = 0
    while streak < 3:
        streak = streak + 1 if routed_to(gateway, tokenized) == holder else 0
        assert time.monotonic() < deadline, "the EPP never learnt where the prefix is cached"
    # Picked blind among three replicas, five in a row would land there 1 time in 243.
    assert [routed_to(gateway, tokenized) for _ in range(5)] == [holder] * 5


def test_same_prefix_lands_on_the_same_replica(gateway: Gateway) -> None:
    # The engines publish one-token pages; the EPP regroups them into its 16-token blocks, and
    # with speculation off only those KV events can send a prefix back where it is cached. The
    # probes just sent to the holder ended, so they no longer count as load there.
    shared = prompt(10, blocks=4)
    first = request([*shared, *prompt(11, blocks=1)])
    (done,) = stub(gateway).Generate(first, metadata=[(FAIRNESS_ID, "sg-first")],
                                     timeout=CALL_TIMEOUT)
    assert done.complete.cached_tokens == 0
    holder = endpoint_of(gateway, "sg-first")
    assert_follows_its_cache(gateway, pb.TokenizedInput(input_ids=[*shared, 7, 8]), holder)
    again = generate(stub(gateway), [*shared, *prompt(12, blocks=1)])
    assert again.cached_tokens >= len(shared)


def test_original_text_alone_is_routed_and_served(gateway: Gateway) -> None:
    text = " ".join(f"sentence {i} of a shared preamble" for i in range(30))
    first = pb.GenerateRequest(request_id="sg-text-1", tokenized=pb.TokenizedInput(
        original_text=text), sampling_params=pb.SamplingParams(max_new_tokens=2))
    done = list(stub(gateway).Generate(first, metadata=[(FAIRNESS_ID, "sg-text")],
                                       timeout=CALL_TIMEOUT))[-1].complete
    assert done.completion_tokens == 2 and done.prompt_tokens > 100
    holder = endpoint_of(gateway, "sg-text")
    assert cached_on(gateway, load_tokenizer(None).encode(text)) == [holder]
    # The EPP tokenizes the text to route it by its prefix.
    assert_follows_its_cache(gateway, pb.TokenizedInput(original_text=text), holder)


def test_bad_input_is_invalid_argument(gateway: Gateway) -> None:
    call = gateway.channel.unary_stream(
        "/sglang.grpc.scheduler.SglangScheduler/Generate",
        request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
    with pytest.raises(grpc.RpcError) as info:
        list(call(b"\xff\xff\xff\xff\x0f garbage", timeout=CALL_TIMEOUT))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    connection = http.client.HTTPConnection("127.0.0.1", gateway.launched.ports.public,
                                            timeout=20)
    try:  # a frame announcing 4096 bytes and carrying 6
        connection.request("POST", "/sglang.grpc.scheduler.SglangScheduler/Generate",
                           body=b"\x00\x00\x00\x10\x00short",
                           headers={"content-type": "application/grpc", "te": "trailers"})
        response = connection.getresponse()
        response.read()
        assert response.getheader("grpc-status") == "3"
    finally:
        connection.close()
    with pytest.raises(grpc.RpcError) as refused:  # the engine's own check, through the gateway
        generate(stub(gateway), prompt(4), max_new_tokens=5000)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert generate(stub(gateway), prompt(5)).completion_tokens == 8


def test_usage_is_recorded_and_loads_are_read(gateway: Gateway) -> None:
    done = generate(stub(gateway), prompt(6), max_new_tokens=5)
    labels = {"fairness_id": "tenant-sglang"}
    deadline = time.monotonic() + 10
    while sum(epp_samples(gateway, "kvswitch_epp_completion_tokens_total", **labels)) < 5:
        assert time.monotonic() < deadline, "the finished request's usage was never recorded"
        time.sleep(0.05)
    assert done.completion_tokens == 5
    assert sum(epp_samples(gateway, "kvswitch_epp_endpoint_ready")) == 3


def test_openai_through_the_frontend(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=f"http://{gateway.launched.address}/v1", api_key="-",
                           timeout=CALL_TIMEOUT)
    model = client.models.list().data[0].id
    answer = client.completions.create(model=model, prompt="one two three four", max_tokens=4)
    assert answer.choices[0].text == "one two three four"
    text = "".join(e.choices[0].delta.content or "" for e in client.chat.completions.create(
        model=model, max_tokens=3, stream=True, messages=[{"role": "user", "content": "Hi"}])
        if e.choices)
    assert text
