"""Requests through the real gateway: Envoy → EPP (ext_proc) → `kvswitch engine` replicas."""

from __future__ import annotations

import http.client
import struct
import time
import urllib.request

import grpc
import pytest

from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.headers import FAIRNESS_ID, OBJECTIVE
from tests.support.gateway import (
    BLOCK,
    CALL_TIMEOUT,
    Gateway,
    cached_on,
    epp_samples,
    generate,
    generate_request,
    prompt,
)

TENANT = [(FAIRNESS_ID, "tenant-a"), (OBJECTIVE, "e2e-objective")]


def test_unary_generate(gateway: Gateway) -> None:
    ids = prompt(1)
    complete = generate(gateway.stub, ids, max_tokens=8, metadata=TENANT)
    assert complete.completion_tokens == 8
    assert len(complete.output_ids) == 8
    assert complete.prompt_tokens == len(ids)
    assert complete.finish_reason == "length"


def test_streamed_generate(gateway: Gateway) -> None:
    ids = prompt(2)
    responses = list(gateway.stub.Generate(generate_request(ids, max_tokens=16, stream=True),
                                           metadata=TENANT, timeout=CALL_TIMEOUT))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    assert responses[-1].HasField("complete")
    assert sum(len(c.token_ids) for c in chunks) == 16
    assert responses[-1].complete.finish_reason == "length"


def test_embed(gateway: Gateway) -> None:
    ids = prompt(3)
    response = gateway.stub.Embed(
        pb.EmbedRequest(request_id="e2e-embed", tokenized=pb.TokenizedInput(input_ids=ids)),
        metadata=TENANT, timeout=CALL_TIMEOUT)
    assert response.prompt_tokens == len(ids)
    assert len(response.embedding) == response.embedding_dim > 0


def test_same_prefix_lands_on_the_same_replica(gateway: Gateway) -> None:
    """Back-to-back requests of a prefix group stay where the prefix is, however short it is
    (64 tokens): a request that ended no longer counts as load on its replica."""
    shared = prompt(10, blocks=4)
    first = generate(gateway.stub, [*shared, *prompt(11, blocks=1)])
    assert first.cached_tokens == 0
    for suffix_seed in (12, 13, 14):
        again = generate(gateway.stub, [*shared, *prompt(suffix_seed, blocks=1)])
        # Only the replica that served the first request holds the shared blocks.
        assert again.cached_tokens >= len(shared), again
    assert len(cached_on(gateway.engines, shared)) == 1


def test_long_text_prompts_are_routed_by_their_exact_prefix(gateway: Gateway) -> None:
    """Texts this long are tokenized in the EPP's worker thread (the route suspends and
    resumes in the ext_proc stream); the match is still exact: the same shared text lands
    where its blocks are cached."""
    from kvswitch.tokenization import load_tokenizer
    from kvswitch.tokenization.offload import needs_offload

    shared = " ".join(f"clause {i} of the long shared system prompt;" for i in range(80))
    assert needs_offload(shared)
    shared_tokens = len(load_tokenizer(None).encode(shared))

    def complete(suffix: str) -> pb.GenerateComplete:
        request = pb.GenerateRequest(
            request_id=f"e2e-long-text-{suffix}", text=f"{shared} {suffix}",
            sampling_params=pb.SamplingParams(max_tokens=2, ignore_eos=True))
        responses = list(gateway.stub.Generate(request, metadata=TENANT, timeout=CALL_TIMEOUT))
        assert responses[-1].HasField("complete"), responses
        return responses[-1].complete

    assert complete("first").cached_tokens == 0
    # Routed blind, all four would reach the first one's replica only 1 time in 4**4.
    for suffix in ("second", "third", "fourth", "fifth"):
        # Every full block of the shared text (bar the one its suffix changes) was cached.
        assert complete(suffix).cached_tokens >= (shared_tokens // BLOCK - 1) * BLOCK


def test_different_prefixes_spread(gateway: Gateway) -> None:
    seeds = range(100, 112)
    for seed in seeds:
        generate(gateway.stub, prompt(seed))
    holders = {seed: cached_on(gateway.engines, prompt(seed)) for seed in seeds}
    assert all(len(h) == 1 for h in holders.values()), holders
    used = {h[0] for h in holders.values()}
    assert len(used) >= 2, holders


def test_spoofed_destination_header_is_ignored(gateway: Gateway) -> None:
    # Nothing listens on port 1; obeying the client would fail the call.
    spoof = [("x-gateway-destination-endpoint", "127.0.0.1:1")]
    complete = generate(gateway.stub, prompt(20), metadata=spoof)
    assert complete.completion_tokens == 8
    # Nor can a client pin a replica: the second request follows its prefix, not the header.
    shared = prompt(21)
    generate(gateway.stub, shared)
    (holder,) = cached_on(gateway.engines, shared)
    other = next(a for a in gateway.engines if a != holder)
    again = generate(gateway.stub, shared, metadata=[("x-gateway-destination-endpoint", other)])
    assert again.cached_tokens >= len(shared) - BLOCK


def test_subset_hint_header_restricts_the_pick(gateway: Gateway) -> None:
    target = gateway.engines[2]
    ids = prompt(30)
    generate(gateway.stub, ids, metadata=[("x-gateway-destination-endpoint-subset", target)])
    assert cached_on(gateway.engines, ids) == [target]


def test_subset_hint_with_no_eligible_endpoint_is_unavailable(gateway: Gateway) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(gateway.stub, prompt(31),
                 metadata=[("x-gateway-destination-endpoint-subset", "127.0.0.1:1")])
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_undecodable_protobuf_is_invalid_argument(gateway: Gateway) -> None:
    call = gateway.channel.unary_stream(
        "/vllm.grpc.engine.VllmEngine/Generate",
        request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
    with pytest.raises(grpc.RpcError) as info:
        list(call(b"\xff\xff\xff\xff\x0f garbage", timeout=CALL_TIMEOUT))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The gateway keeps serving everyone else.
    assert generate(gateway.stub, prompt(40)).completion_tokens == 8


@pytest.mark.parametrize("body", [
    b"\x00\x00\x00\x10\x00short",  # the frame announces 4096 bytes, carries 6
    b"\x02\x00\x00\x00\x01\x00",  # flags byte other than 0 (uncompressed) or 1
])
def test_malformed_grpc_frame_is_invalid_argument(gateway: Gateway, body: bytes) -> None:
    # Sent as HTTP/1.1 so the frame bytes are exactly ours (a gRPC client always frames well).
    connection = http.client.HTTPConnection("127.0.0.1", gateway.launched.ports.public, timeout=20)
    try:
        connection.request("POST", "/vllm.grpc.engine.VllmEngine/Generate", body=body,
                           headers={"content-type": "application/grpc", "te": "trailers"})
        response = connection.getresponse()
        response.read()
        assert response.getheader("grpc-status") == str(grpc.StatusCode.INVALID_ARGUMENT.value[0])
    finally:
        connection.close()
    assert generate(gateway.stub, prompt(41)).completion_tokens == 8


def test_well_formed_frame_over_http1_is_served(gateway: Gateway) -> None:
    message = generate_request(prompt(42), max_tokens=2).SerializeToString()
    connection = http.client.HTTPConnection("127.0.0.1", gateway.launched.ports.public, timeout=20)
    try:
        connection.request("POST", "/vllm.grpc.engine.VllmEngine/Generate",
                           body=struct.pack(">BI", 0, len(message)) + message,
                           headers={"content-type": "application/grpc", "te": "trailers"})
        response = connection.getresponse()
        payload = response.read()
    finally:
        connection.close()
    assert response.status == 200
    _flags, length = struct.unpack(">BI", payload[:5])
    reply = pb.GenerateResponse.FromString(payload[5:5 + length])
    assert reply.complete.completion_tokens == 2


def test_usage_status_and_duration_are_recorded_per_tenant(gateway: Gateway) -> None:
    tenant = [(FAIRNESS_ID, "tenant-usage"), (OBJECTIVE, "e2e-objective")]
    ids = prompt(30)
    complete = generate(gateway.stub, ids, max_tokens=8, metadata=tenant)
    labels = {"fairness_id": "tenant-usage", "objective": "e2e-objective"}
    # The EPP records at the response trailers, which may reach it just after the client.
    deadline = time.monotonic() + 10
    while not epp_samples(gateway, "kvswitch_epp_requests_finished_total", **labels):
        assert time.monotonic() < deadline, "the finished request was never recorded"
        time.sleep(0.05)
    assert epp_samples(gateway, "kvswitch_epp_requests_finished_total", ok="true",
                        status="OK", **labels) == [1.0]
    assert epp_samples(gateway, "kvswitch_epp_prompt_tokens_total", **labels) == [len(ids)]
    assert epp_samples(gateway, "kvswitch_epp_completion_tokens_total", **labels) == [
        complete.completion_tokens]
    assert epp_samples(gateway, "kvswitch_epp_request_duration_seconds_count", **labels) == [1.0]


def _logs_written(gateway: Gateway) -> int:
    """Access-log entries Envoy has sent towards the EPP (its gRPC access logger's counter)."""
    url = f"http://127.0.0.1:{gateway.launched.ports.admin}/stats?filter=logs_written"
    with urllib.request.urlopen(url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            name, _, value = line.partition(": ")
            if name == "access_logs.grpc_access_log.logs_written":
                return int(value)
    return 0


def test_only_requests_the_epp_routed_are_logged_to_it(gateway: Gateway) -> None:
    before = _logs_written(gateway)
    for seed in (40, 41):  # answered by the EPP itself: nothing waits for their entries
        with pytest.raises(grpc.RpcError):
            generate(gateway.stub, prompt(seed),
                     metadata=[("x-gateway-destination-endpoint-subset", "127.0.0.1:1")])
    assert _logs_written(gateway) == before
    generate(gateway.stub, prompt(42))  # routed: its entry tells the EPP how it ended
    deadline = time.monotonic() + 10
    while _logs_written(gateway) == before:
        assert time.monotonic() < deadline, "the routed request was never logged"
        time.sleep(0.05)
    assert _logs_written(gateway) == before + 1
