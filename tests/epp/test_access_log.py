"""Requests that end by the gateway's access-log entry: reading entries (sans-IO), the router
holding such a request in flight until its entry comes, and the EPP's StreamAccessLogs call."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import Metadata
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf.message import DecodeError

from kvswitch.epp import access_log
from kvswitch.epp.access_log import LoggedEnd, ended_requests
from kvswitch.epp.contracts import EndpointPicker, InferenceRequest, RequestOutcome
from kvswitch.epp.parsers import default_parsers
from kvswitch.epp.server import EppServer
from kvswitch.protocol.headers import ACCESS_LOGGED, GATEWAY_METADATA_NAMESPACE, USAGE_TRAILER
from tests.support.extproc import GENERATE, body, grpc_headers, make_stream, route_generate
from tests.support.router import NoBackground, make_router, prompt, request


def entry(request_id: str, *, code: int | None = 200, trailers: dict[str, str] | None = None,
          headers: dict[str, str] | None = None, seconds: float = 1.5,
          intermediate: bool = False) -> al.HTTPAccessLogEntry:
    e = al.HTTPAccessLogEntry()
    e.request.request_id = request_id
    e.common_properties.upstream_remote_address.socket_address.address = "127.0.0.1"
    e.common_properties.upstream_remote_address.socket_address.port_value = 9001
    e.common_properties.duration.FromNanoseconds(int(seconds * 1e9))
    e.common_properties.intermediate_log_entry = intermediate
    if code is not None:
        e.response.response_code.value = code
    e.response.response_trailers.update(trailers or {})
    e.response.response_headers.update(headers or {})
    return e


def message(*entries: al.HTTPAccessLogEntry) -> bytes:
    m = als_pb2.StreamAccessLogsMessage()
    m.identifier.log_name = "kvswitch"
    m.http_logs.log_entry.extend(entries)
    return m.SerializeToString()


# -- reading entries ---------------------------------------------------------------------------


def test_entries_give_status_usage_and_duration() -> None:
    usage = "prompt_tokens=12;completion_tokens=64;cached_tokens=8"
    ends = ended_requests(message(
        entry("a", trailers={"grpc-status": "0", USAGE_TRAILER: usage}),
        entry("b", headers={"grpc-status": "14"}),  # a trailers-only error reply
        entry("c", code=None, seconds=0.25),  # the client left before any response
    ))
    assert ends == [
        LoggedEnd("a", 0, 200, {"prompt_tokens": 12, "completion_tokens": 64, "cached_tokens": 8},
                  1.5),
        LoggedEnd("b", 14, 200, {}, 1.5),
        LoggedEnd("c", None, None, {}, 0.25),
    ]


def test_intermediate_entries_and_entries_without_an_id_are_skipped() -> None:
    assert ended_requests(message(entry("a", intermediate=True), entry(""))) == []
    tcp = als_pb2.StreamAccessLogsMessage()
    tcp.tcp_logs.log_entry.add()
    assert ended_requests(tcp.SerializeToString()) == []


def test_garbage_does_not_parse() -> None:
    with pytest.raises(DecodeError):
        ended_requests(b"\xff\xff\xff")


# -- the mark ----------------------------------------------------------------------------------


def test_only_the_gateways_metadata_marks_a_request_as_logged() -> None:
    marked = Metadata()
    marked.filter_metadata[GATEWAY_METADATA_NAMESPACE].update({ACCESS_LOGGED: True})
    stream = make_stream()
    assert stream.receive(grpc_headers(metadata=marked)) == []
    [need] = stream.receive(body(GENERATE, eos=True))
    assert need.request.access_logged
    # A client can send any header, but not Envoy's dynamic metadata.
    stream = make_stream()
    need = route_generate(stream, ("x-kvswitch-access-logged", "1"), (ACCESS_LOGGED, "true"))
    assert not need.request.access_logged


# -- the router --------------------------------------------------------------------------------


def logged_request(seed: int) -> InferenceRequest:
    return dataclasses.replace(request(prompt(seed, 64)), access_logged=True)


def closed_early(where: str) -> RequestOutcome:
    """What the ext_proc stream reports when it closes before the response's end."""
    return RequestOutcome(where, ok=False, seen_end=False)


async def test_a_logged_request_stays_in_flight_until_its_entry() -> None:
    router = make_router()
    req = logged_request(1)
    where = (await router.route(req, None)).endpoints[0]
    router.request_finished(req, closed_early(where))
    assert router.in_flight()[where] == 1  # the response may still be streaming
    router.request_logged(LoggedEnd(req.request_id, 0, 200, {"completion_tokens": 64}, 2.0))
    assert router.in_flight()[where] == 0
    labels = ("", "", "default-flow", where)
    m = router.metrics
    assert m.finished.value(*labels, "true", "OK") == 1
    assert m.completion_tokens.value(*labels) == 64
    assert m.request_seconds.series[labels][1] == 2.0  # the gateway's duration
    router.request_logged(LoggedEnd(req.request_id, 0, 200, {}, 2.0))  # again: ignored
    assert m.finished.value(*labels, "true", "OK") == 1


async def test_a_grpc_entry_without_grpc_status_is_not_ok() -> None:
    router = make_router()
    req = logged_request(2)
    where = (await router.route(req, None)).endpoints[0]
    router.request_finished(req, closed_early(where))
    router.request_logged(LoggedEnd(req.request_id, None, 200, {}, 1.0))  # the client left
    assert router.metrics.finished.value("", "", "default-flow", where, "false", "200") == 1


async def test_an_entry_before_the_stream_closes_is_used_at_the_close() -> None:
    router = make_router()
    req = logged_request(3)
    where = (await router.route(req, None)).endpoints[0]
    router.request_logged(LoggedEnd(req.request_id, 0, 200, {"prompt_tokens": 64}, 1.0))
    assert router.in_flight()[where] == 1
    router.request_finished(req, closed_early(where))
    assert router.in_flight()[where] == 0
    assert router.metrics.prompt_tokens.value("", "", "default-flow", where) == 64


async def test_unmarked_requests_and_seen_ends_finish_at_once() -> None:
    router = make_router()
    plain = request(prompt(4, 64))  # a gateway that logs nothing to the EPP
    where = (await router.route(plain, None)).endpoints[0]
    router.request_finished(plain, closed_early(where))
    assert router.in_flight()[where] == 0
    req = logged_request(5)
    where = (await router.route(req, None)).endpoints[0]
    router.request_finished(req, RequestOutcome(where, ok=True, grpc_status=0))  # its trailers
    assert router.in_flight()[where] == 0


async def test_waiting_ends_with_the_last_log_stream_or_after_the_wait_limit() -> None:
    router = make_router()
    router.access_log_opened()
    router.access_log_opened()
    reqs = [logged_request(10 + i) for i in range(3)]
    where = [(await router.route(r, None)).endpoints[0] for r in reqs]
    for r, w in zip(reqs, where, strict=True):
        router.request_finished(r, closed_early(w))
    assert sum(router.in_flight().values()) == 3
    router.access_log_closed()  # another stream is still open: entries may still come
    assert sum(router.in_flight().values()) == 3
    router.stop_waiting(older_than=3600.0)  # (what the gauge loop does): none is that old
    assert sum(router.in_flight().values()) == 3
    await asyncio.sleep(0.002)
    router.stop_waiting(older_than=0.001)  # all are older than that: a lost entry's bound
    assert sum(router.in_flight().values()) == 0
    req = logged_request(20)
    w = (await router.route(req, None)).endpoints[0]
    router.request_finished(req, closed_early(w))
    router.access_log_closed()  # the last one: no entry can come any more
    assert router.in_flight()[w] == 0
    assert router.metrics.finished.value("", "", "default-flow", w, "false", "unknown") >= 1


# -- the StreamAccessLogs call -----------------------------------------------------------------


class QuietRouter(NoBackground):
    """The real router without its background work, taking access-log entries too."""

    def request_logged(self, end: LoggedEnd) -> None:
        self.router.request_logged(end)

    def access_log_opened(self) -> None:
        self.router.access_log_opened()

    def access_log_closed(self) -> None:
        self.router.access_log_closed()


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_the_epp_serves_stream_access_logs(transport: str) -> None:
    router = make_router()
    req = logged_request(30)
    where = (await router.route(req, None)).endpoints[0]
    router.request_finished(req, closed_early(where))
    picker = EndpointPicker(default_parsers(), QuietRouter(router))  # type: ignore[arg-type]
    server = EppServer(picker, port=0, transport=transport)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_unary(access_log.SERVICE_PATH)
            reply = await call(iter([
                message(entry(req.request_id, trailers={"grpc-status": "0"})),
            ]), timeout=5)
            assert reply == b""
            bad = channel.stream_unary(access_log.SERVICE_PATH)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await bad(iter([b"\xff\xff\xff"]), timeout=5)
            assert info.value.code() == grpc.StatusCode.INTERNAL
        assert router.in_flight()[where] == 0
        assert router.metrics.finished.value("", "", "default-flow", where, "true", "OK") == 1
    finally:
        await server.stop(0.5)


async def test_a_stopping_epp_ends_the_gateways_log_stream_instead_of_waiting_for_it() -> None:
    router = make_router()
    picker = EndpointPicker(default_parsers(), QuietRouter(router))  # type: ignore[arg-type]
    server = EppServer(picker, port=0)
    port = await server.start()
    release = asyncio.Event()

    async def messages():  # type: ignore[no-untyped-def]
        yield message(entry("nobody", trailers={"grpc-status": "0"}))
        await release.wait()  # Envoy keeps its log stream open

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_unary(access_log.SERVICE_PATH)(messages(), timeout=10)
            for _ in range(200):  # bounded: until the stream is open on the server
                if router.access_log_streams:
                    break
                await asyncio.sleep(0.01)
            started = asyncio.get_running_loop().time()
            await server.stop(grace=5.0)
            assert asyncio.get_running_loop().time() - started < 2.0  # not the grace period
            assert await call == b""
            assert router.access_log_streams == 0
    finally:
        release.set()
