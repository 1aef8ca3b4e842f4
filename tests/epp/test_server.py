"""The EPP's ext_proc server on loopback (both transports), driven by grpc.aio; a fake Router."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvswitch.epp.contracts import EndpointPicker
from kvswitch.epp.parsers import default_parsers
from kvswitch.epp.server import EXT_PROC_SERVICE, EppServer
from tests.support.extproc import GENERATE, body, grpc_headers, response_headers, response_trailers
from tests.support.router import FakeRouter


@pytest.fixture
async def router() -> FakeRouter:
    return FakeRouter()


@pytest.fixture(params=["h2", "grpcio"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def server(router: FakeRouter, transport: str) -> AsyncIterator[EppServer]:
    srv = EppServer(EndpointPicker(parsers=default_parsers(), router=router), port=0,
                    transport=transport)
    await srv.start()
    yield srv
    await srv.stop(grace=0.1)


@pytest.fixture
async def channel(server: EppServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


async def test_generate_round_trip_over_grpc(router: FakeRouter, channel: grpc.aio.Channel) -> None:
    call = ep_grpc.ExternalProcessorStub(channel).Process()
    await call.write(grpc_headers(("x-request-id", "r1")))
    await call.write(body(GENERATE, eos=True))
    headers_reply = await call.read()
    echo = await call.read()
    dest = headers_reply.request_headers.response.header_mutation.set_headers[0].header
    assert (dest.key, dest.raw_value) == ("x-gateway-destination-endpoint", b"10.0.0.1:8000")
    assert headers_reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == "10.0.0.1:8000"
    assert echo.request_body.response.body_mutation.streamed_response.body == GENERATE
    assert router.routed[0][0].body.prompt_token_ids is not None

    await call.write(response_headers((":status", "200")))
    assert (await call.read()).HasField("response_headers")
    await call.write(response_trailers(("grpc-status", "0"),
                                       ("x-kvswitch-usage",
                                        "prompt_tokens=100;completion_tokens=16")))
    assert (await call.read()).HasField("response_trailers")
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    await asyncio.wait_for(router.finished_event.wait(), 5)
    [(request, outcome)] = router.finished
    assert request.request_id == "r1"
    assert (outcome.ok, outcome.prompt_tokens, outcome.completion_tokens) == (True, 100, 16)


async def test_cancelled_stream_finishes_the_request_once(router: FakeRouter,
                                                          channel: grpc.aio.Channel) -> None:
    call = ep_grpc.ExternalProcessorStub(channel).Process()
    await call.write(grpc_headers())
    await call.write(body(GENERATE, eos=True))
    await call.read()
    await call.read()
    call.cancel()  # what Envoy does when the client goes away or the upstream resets
    await asyncio.wait_for(router.finished_event.wait(), 5)
    await asyncio.sleep(0.1)
    [(_, outcome)] = router.finished
    assert not outcome.ok and outcome.endpoint == "10.0.0.1:8000"


async def test_router_failure_becomes_unavailable(router: FakeRouter,
                                                  channel: grpc.aio.Channel) -> None:
    router.fail = True
    call = ep_grpc.ExternalProcessorStub(channel).Process()
    await call.write(grpc_headers())
    await call.write(body(GENERATE, eos=True))
    reply = await call.read()
    assert reply.immediate_response.grpc_status.status == grpc.StatusCode.UNAVAILABLE.value[0]
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert router.finished == []


async def test_health_services_answer(server: EppServer, router: FakeRouter,
                                      channel: grpc.aio.Channel) -> None:
    assert router.started
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "liveness", "readiness", EXT_PROC_SERVICE):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_health_watch_streams_changes_and_ends_at_stop(router: FakeRouter,
                                                             transport: str) -> None:
    srv = EppServer(EndpointPicker(parsers=default_parsers(), router=router), port=0,
                    transport=transport)
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
            unknown = stub.Watch(health_pb2.HealthCheckRequest(service="nope"))
            first = await asyncio.wait_for(watch.read(), 5)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            # An unknown service is not an error for Watch: SERVICE_UNKNOWN, and it goes on.
            assert (await asyncio.wait_for(unknown.read(), 5)).status == \
                health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            await srv.stop(grace=1.0)
            last = await asyncio.wait_for(watch.read(), 5)
            assert last.status == health_pb2.HealthCheckResponse.NOT_SERVING
            if transport == "h2":  # ended at once with OK, so it does not hold the drain
                assert await asyncio.wait_for(watch.read(), 5) is grpc.aio.EOF
                assert await watch.code() == grpc.StatusCode.OK
            unknown.cancel()
    finally:
        await srv.stop(grace=0.1)


async def test_reflection_lists_ext_proc(channel: grpc.aio.Channel, transport: str) -> None:
    if transport == "h2":
        pytest.skip("reflection is served by the grpcio transport only")
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    reply = await call.read()
    names = {s.name for s in reply.list_services_response.service}
    assert {EXT_PROC_SERVICE, "grpc.health.v1.Health"} <= names
    await call.done_writing()


async def test_graceful_stop_reports_not_serving_and_stops_the_router(router: FakeRouter,
                                                                     transport: str) -> None:
    srv = EppServer(EndpointPicker(parsers=default_parsers(), router=router), port=0,
                    transport=transport)
    await srv.start()
    await srv.stop(grace=0.1)
    assert router.stopped
    assert srv.health_status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
