"""The gRPC client's sans-IO core (`H2ClientConnection`) against the `h2` library as the server,
byte for byte over an in-memory pipe, no event loop. h2 checks every frame the core writes by
RFC 9113; hypothesis writes the server's side (messages of any size, padded or not, cut into
frames anywhere, headers indexed or not, a status and message, the bytes read in any cuts), and
the core's events must say exactly what the server sent."""

from __future__ import annotations

import struct

import h2.config
import h2.connection
import h2.events
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswitch.protocol.h2client_core import (
    CallEnded,
    ClientEvent,
    GoAwayReceived,
    H2ClientConnection,
    MessagesReceived,
    PingAcked,
)

PATH = "/x.Y/Z"


def grpc(message: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(message)) + message


class Pipe:
    """The core and an h2 server back to back; `pump()` moves bytes both ways until neither has
    anything to say, handing the core its bytes in reads of `read_size`."""

    def __init__(self, scheme: str = "http", read_size: int = 1 << 30) -> None:
        self.server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.server.initiate_connection()
        self.client = H2ClientConnection("peer:1", scheme=scheme)
        self.client.initiate()
        self.read_size = read_size
        self.events: list[ClientEvent] = []
        self.server_events: list[h2.events.Event] = []
        self.requests: dict[int, dict[str, str]] = {}
        self.bodies: dict[int, bytes] = {}

    def pump(self) -> None:
        for _ in range(1000):
            upstream = self.client.data_to_send()
            if upstream:
                for event in self.server.receive_data(upstream):
                    self.server_events.append(event)
                    if isinstance(event, h2.events.RequestReceived):
                        self.requests[event.stream_id] = {
                            k.decode(): v.decode() for k, v in event.headers}
                    elif isinstance(event, h2.events.DataReceived):
                        self.bodies[event.stream_id] = (
                            self.bodies.get(event.stream_id, b"") + event.data)
                        self.server.acknowledge_received_data(event.flow_controlled_length,
                                                              event.stream_id)
            downstream = self.server.data_to_send()
            for start in range(0, len(downstream), self.read_size):
                self.events += self.client.receive(downstream[start:start + self.read_size])
            if not upstream and not downstream:
                return
        raise AssertionError("the peers never went quiet")

    def messages(self, stream_id: int) -> list[bytes]:
        return [m for e in self.events if isinstance(e, MessagesReceived)
                and e.stream_id == stream_id for m in e.messages]

    def ended(self) -> list[CallEnded]:
        return [e for e in self.events if isinstance(e, CallEnded)]


def test_the_request_h2_reads_is_the_call_started_with_its_scheme() -> None:
    pipe = Pipe(scheme="https")
    stream_id = pipe.client.start_call(PATH, [("x-tenant", "a")], b"request", timeout=1.5)
    pipe.pump()
    assert pipe.requests[stream_id] == {
        ":method": "POST", ":scheme": "https", ":path": PATH, ":authority": "peer:1",
        "content-type": "application/grpc", "te": "trailers", "user-agent": "kvswitch-frontend",
        "grpc-timeout": "1500m", "x-tenant": "a"}
    assert pipe.bodies[stream_id] == grpc(b"request")
    assert any(isinstance(e, h2.events.StreamEnded) for e in pipe.server_events)


_responses = st.lists(st.binary(max_size=3000), max_size=6)
_status = st.sampled_from([("0", ""), ("5", "not found"), ("13", "bad % thing é"), ("8", "")])


@settings(max_examples=60, deadline=None)
@given(messages=_responses, status=_status, frame_size=st.integers(1, 5000),
       pad=st.one_of(st.none(), st.integers(0, 255)), read_size=st.integers(1, 4000),
       calls=st.integers(1, 3))
def test_what_an_h2_server_sends_is_what_the_core_reports(
        messages: list[bytes], status: tuple[str, str], frame_size: int, pad: int | None,
        read_size: int, calls: int) -> None:
    pipe = Pipe(read_size=read_size)
    ids = [pipe.client.start_call(PATH, (), b"") for _ in range(calls)]
    pipe.pump()
    code, details = status
    for stream_id in ids:  # interleaved: every stream's frames cut at `frame_size`
        assert stream_id is not None
        pipe.server.send_headers(stream_id, [(":status", "200"),
                                             ("content-type", "application/grpc")])
        body = b"".join(grpc(m) for m in messages)
        for start in range(0, len(body), frame_size):
            pipe.server.send_data(stream_id, body[start:start + frame_size], pad_length=pad)
        trailers = [("grpc-status", code)] + ([("grpc-message", details)] if details else [])
        pipe.server.send_headers(stream_id, trailers, end_stream=True)
    pipe.pump()
    for stream_id in ids:
        assert pipe.messages(stream_id) == messages
    assert pipe.ended() == [CallEnded(i, int(code), details) for i in ids]
    assert pipe.client.calls == {} and not pipe.client.failed
    # Every byte the server sent was given back (h2 would refuse more otherwise).
    assert pipe.server.outbound_flow_control_window > 0


def test_a_cancelled_call_is_a_reset_h2_sees_and_other_calls_go_on() -> None:
    pipe = Pipe()
    first = pipe.client.start_call(PATH, (), b"")
    second = pipe.client.start_call(PATH, (), b"")
    pipe.pump()
    pipe.client.reset(first)
    pipe.pump()
    resets = [e for e in pipe.server_events if isinstance(e, h2.events.StreamReset)]
    assert [(e.stream_id, e.error_code) for e in resets] == [(first, 8)]
    pipe.server.send_headers(second, [(":status", "200")])
    pipe.server.send_data(second, grpc(b"still here"))
    pipe.server.send_headers(second, [("grpc-status", "0")], end_stream=True)
    pipe.pump()
    assert pipe.messages(second) == [b"still here"]
    assert pipe.ended() == [CallEnded(second, 0, "")]


def test_pings_both_ways_and_a_goaway_from_h2() -> None:
    pipe = Pipe()
    first = pipe.client.start_call(PATH, (), b"")
    second = pipe.client.start_call(PATH, (), b"")
    pipe.pump()
    pipe.client.ping(b"keepaliv")
    pipe.server.ping(b"srv-ping")
    pipe.pump()
    assert PingAcked(b"keepaliv") in pipe.events
    assert [e.ping_data for e in pipe.server_events
            if isinstance(e, h2.events.PingAckReceived)] == [b"srv-ping"]
    pipe.server.close_connection(last_stream_id=first)
    pipe.pump()
    assert pipe.ended() == [CallEnded(second, 14, "connection closing (GOAWAY)")]
    assert pipe.events[-1] == GoAwayReceived(first, 0)
    assert pipe.client.start_call(PATH, (), b"") is None


def test_a_small_window_and_frame_size_from_h2_shape_what_the_core_sends() -> None:
    pipe = Pipe()
    pipe.server.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})
    pipe.pump()
    assert pipe.client.start_call(PATH, (), b"x" * 96) is None  # 101 bytes framed: over
    stream_id = pipe.client.start_call(PATH, (), b"x" * 95)
    pipe.pump()
    assert pipe.bodies[stream_id] == grpc(b"x" * 95)
