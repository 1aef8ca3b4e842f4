"""A request waiting in flow control whose ext_proc stream Envoy resets gives its slot back."""

from __future__ import annotations

import asyncio

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvswitch.epp.contracts import EndpointPicker
from kvswitch.epp.datalayer import Endpoint, EndpointSpec, Metrics
from kvswitch.epp.flowcontrol import FlowGate, SaturationConfig
from kvswitch.epp.flowcontrol.core import DISPATCH
from kvswitch.epp.parsers import default_parsers
from kvswitch.epp.server import EppServer
from tests.support.extproc import GENERATE, body, grpc_headers
from tests.support.router import ADDRS, NoBackground, config, make_router, prompt, request, set_load
from tests.support.waiting import until


async def test_stream_reset_while_queued_releases_the_queue_slot() -> None:
    router = make_router(config(featureGates=["flowControl"], flowControl={"maxWait": "30s"}))
    for a in ADDRS:
        set_load(router, a, waiting=9)  # saturated: the request queues
    server = EppServer(EndpointPicker(default_parsers(),
                                      NoBackground(router)),  # type: ignore[arg-type]
                       port=0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process()
            await call.write(grpc_headers())
            await call.write(body(GENERATE, eos=True))
            await until(lambda: len(router.gate.queues) == 1)
            call.cancel()  # Envoy resets the stream
            await until(lambda: len(router.gate.queues) == 0 and not router.gate._waiters)
    finally:
        await server.stop(grace=0.1)
    assert router.in_flight() == dict.fromkeys(ADDRS, 0)
    set_load(router, ADDRS[1], waiting=0)
    assert (await router.route(request(prompt(1)), None)).endpoints == (ADDRS[1],)


async def test_cancelled_after_release_hands_the_slot_to_the_next_waiter() -> None:
    e = Endpoint(EndpointSpec("a:1"))
    e.metrics = Metrics(waiting=5)
    e.healthy = True
    gate = FlowGate(lambda: [e], SaturationConfig(queue_depth_threshold=5))
    first = asyncio.ensure_future(gate.admit("t", 0, [e]))
    second = asyncio.ensure_future(gate.admit("t", 0, [e]))
    await asyncio.sleep(0)
    assert len(gate.queues) == 2
    e.metrics = Metrics(waiting=4)  # room for exactly one
    gate.pump()  # releases `first`...
    first.cancel()  # ...whose stream is reset before it resumes
    assert await second == DISPATCH  # the slot went on to the next waiter
    assert first.cancelled() and len(gate.queues) == 0
