"""Frame-level tests of the shared HTTP/2 frame layer (`kvswitch.protocol.http2`): exact bytes
in, frames or a connection error (its code) out, as the `h2` library tests its state machine."""

from __future__ import annotations

import struct

import pytest
from hpack import Encoder

from kvswitch.protocol.http2 import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    FrameReader,
    H2ProtocolError,
    HeaderDecoder,
    frame,
    goaway_fields,
    goaway_frame,
    header_frames,
    hpack_literal,
    ping_ack,
    settings_entries,
)

SETTINGS_FRAME = frame(SETTINGS, 0, 0)


class Recorder:
    """A `FrameReader` whose frames are kept as (type, flags, stream id, payload, length)."""

    def __init__(self, **options: int) -> None:
        self.frames: list[tuple[int, int, int, bytes, int]] = []
        self.reader = FrameReader(self.on_data, self.on_frame,
                                  max_header_block=options.pop("max_header_block", 1 << 16),
                                  **options)

    def on_data(self, flags: int, stream_id: int, payload: bytes, length: int) -> None:
        self.frames.append((DATA, flags, stream_id, payload, length))

    def on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes, length: int) -> None:
        self.frames.append((kind, flags, stream_id, payload, length))

    def started(self) -> Recorder:
        """Past the peer's first SETTINGS, with a run of idle frames ended (by HEADERS)."""
        self.feed(SETTINGS_FRAME + frame(HEADERS, END_HEADERS, 1, b"\x82"))
        return self

    def feed(self, data: bytes) -> list[tuple[int, int, int, bytes, int]]:
        self.reader.feed(data)
        frames, self.frames = self.frames, []
        return frames


def read(wire: bytes, **options: int) -> list[tuple[int, int, int, bytes, int]]:
    """The frames after the peer's first SETTINGS."""
    return Recorder(**options).feed(SETTINGS_FRAME + wire)[1:]


def error_of(wire: bytes, **options: int) -> int:
    with pytest.raises(H2ProtocolError) as caught:
        Recorder(**options).feed(wire if options.get("preface") else SETTINGS_FRAME + wire)
    return caught.value.code


def test_frames_come_out_with_their_fields() -> None:
    wire = (frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 100)) + frame(PING, ACK, 0, b"8bytes!!")
            + frame(DATA, END_STREAM, 3, b"body") + frame(WINDOW_UPDATE, 0, 3, b"\x00\x00\x00\x01"))
    assert read(wire) == [
        (SETTINGS, 0, 0, struct.pack(">HI", 4, 100), 6), (PING, ACK, 0, b"8bytes!!", 8),
        (DATA, END_STREAM, 3, b"body", 4), (WINDOW_UPDATE, 0, 3, b"\x00\x00\x00\x01", 4)]


def test_frames_split_anywhere_across_reads_come_out_once_whole() -> None:
    wire = PREFACE + frame(SETTINGS, 0, 0) + frame(DATA, 0, 1, b"x" * 40_000) + frame(PING, 0, 0,
                                                                                        b"p" * 8)
    for step in (1, 7, 9, 4096):
        recorder = Recorder(preface=True)
        got = [f for start in range(0, len(wire), step)
               for f in recorder.feed(wire[start:start + step])]
        assert [(k, len(p)) for k, _, _, p, _ in got] == [(SETTINGS, 0), (DATA, 40_000), (PING, 8)]


def test_the_reserved_stream_bit_is_ignored() -> None:
    assert read(frame(DATA, 0, 0x80000001, b"x"))[0][2] == 1


def test_padding_is_removed_but_counts_as_flow_controlled_length() -> None:
    [(_, _, _, payload, length)] = read(frame(DATA, PADDED, 1, b"\x03abcPPP"))
    assert (payload, length) == (b"abc", 7)
    [(_, _, _, payload, length)] = read(frame(DATA, PADDED, 1, b"\x00"))
    assert (payload, length) == (b"", 1)


def test_a_header_block_arrives_whole_without_padding_or_priority() -> None:
    first = b"\x02" + b"\x00\x00\x00\x00\x10" + b"ab" + b"PP"  # pad 2, priority, fragment "ab"
    wire = (frame(HEADERS, PADDED | PRIORITY_FLAG | END_STREAM, 1, first)
            + frame(CONTINUATION, 0, 1, b"cd") + frame(CONTINUATION, END_HEADERS, 1, b"ef"))
    assert read(wire) == [(HEADERS, PADDED | PRIORITY_FLAG | END_STREAM | END_HEADERS, 1,
                           b"abcdef", 2)]


def test_the_header_block_cap_counts_every_fragment() -> None:
    fits = frame(HEADERS, 0, 1, b"x" * 6) + frame(CONTINUATION, END_HEADERS, 1, b"y" * 4)
    assert read(fits, max_header_block=10)[0][3] == b"x" * 6 + b"y" * 4
    over = frame(HEADERS, 0, 1, b"x" * 6) + frame(CONTINUATION, 0, 1, b"y" * 5)
    assert error_of(over, max_header_block=10) == ENHANCE_YOUR_CALM
    assert error_of(frame(HEADERS, END_HEADERS, 1, b"x" * 11), max_header_block=10) \
        == ENHANCE_YOUR_CALM


def test_frames_before_a_broken_one_are_handed_over_first() -> None:
    recorder = Recorder()
    with pytest.raises(H2ProtocolError):
        recorder.feed(SETTINGS_FRAME + frame(PING, 0, 0, b"12345678") + frame(PING, 0, 0, b"12"))
    assert [kind for kind, *_ in recorder.frames] == [SETTINGS, PING]


@pytest.mark.parametrize("first", [
    frame(PING, 0, 0, b"12345678"), frame(SETTINGS, ACK, 0), frame(DATA, 0, 1, b"x"),
    frame(HEADERS, END_HEADERS, 1, b"\x82")])
def test_the_first_frame_must_be_settings(first: bytes) -> None:
    for side, wire in ((Recorder(), first), (Recorder(preface=True), PREFACE + first)):
        with pytest.raises(H2ProtocolError) as caught:
            side.feed(wire)
        assert caught.value.code == PROTOCOL_ERROR


@pytest.mark.parametrize(("wire", "code"), [
    (b"\x00\x40\x01" + b"\x00" * 6, FRAME_SIZE_ERROR),  # 16 KiB + 1 with a 16 KiB maximum
    (frame(PING, 0, 0, b"1234"), FRAME_SIZE_ERROR),
    (frame(PING, 0, 1, b"12345678"), PROTOCOL_ERROR),
    (frame(SETTINGS, 0, 0, b"\x00\x04\x00"), FRAME_SIZE_ERROR),
    (frame(SETTINGS, ACK, 0, b"\x00" * 6), FRAME_SIZE_ERROR),
    (frame(SETTINGS, 0, 1), PROTOCOL_ERROR),
    (frame(WINDOW_UPDATE, 0, 0, b"\x00"), FRAME_SIZE_ERROR),
    (frame(RST_STREAM, 0, 1, b""), FRAME_SIZE_ERROR),
    (frame(RST_STREAM, 0, 0, b"\x00\x00\x00\x08"), PROTOCOL_ERROR),
    (frame(PRIORITY, 0, 1, b"\x00"), FRAME_SIZE_ERROR),
    (frame(PRIORITY, 0, 0, b"\x00" * 5), PROTOCOL_ERROR),
    (frame(GOAWAY, 0, 0, b"\x00" * 7), FRAME_SIZE_ERROR),
    (frame(GOAWAY, 0, 1, b"\x00" * 8), PROTOCOL_ERROR),
    (frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
    (frame(HEADERS, END_HEADERS, 0, b"\x82"), PROTOCOL_ERROR),
    (frame(DATA, PADDED, 1, b""), PROTOCOL_ERROR),
    (frame(DATA, PADDED, 1, b"\x04abc"), PROTOCOL_ERROR),  # pad length = the payload length
    (frame(HEADERS, PADDED | END_HEADERS, 1, b""), PROTOCOL_ERROR),
    (frame(HEADERS, PADDED | PRIORITY_FLAG | END_HEADERS, 1, b"\x01" + b"\x00" * 5),
     PROTOCOL_ERROR),  # the padding eats into the priority
    (frame(HEADERS, PRIORITY_FLAG | END_HEADERS, 1, b"\x00" * 4), FRAME_SIZE_ERROR),
    (frame(CONTINUATION, END_HEADERS, 1, b"\x82"), PROTOCOL_ERROR),
    (frame(HEADERS, 0, 1, b"\x82") + frame(PING, 0, 0, b"12345678"), PROTOCOL_ERROR),
    (frame(HEADERS, 0, 1, b"\x82") + frame(DATA, 0, 1, b"x"), PROTOCOL_ERROR),
    (frame(HEADERS, 0, 1, b"\x82") + frame(CONTINUATION, END_HEADERS, 3, b"\x82"), PROTOCOL_ERROR),
    (frame(PUSH_PROMISE, END_HEADERS, 1, b"\x00\x00\x00\x02"), PROTOCOL_ERROR),
])
def test_broken_frames_are_connection_errors(wire: bytes, code: int) -> None:
    assert error_of(wire, max_frame=16384) == code


@pytest.mark.parametrize("start", [b"GET / HTTP/1.1\r\n\r\n", b"PRI * HTTP/1.1"])
def test_the_server_side_wants_the_preface(start: bytes) -> None:
    assert error_of(start, preface=True) == PROTOCOL_ERROR
    assert error_of(PREFACE + frame(PING, 0, 0, b"12345678"), preface=True) == PROTOCOL_ERROR


def test_the_preface_may_arrive_a_byte_at_a_time() -> None:
    recorder = Recorder(preface=True)
    for byte in PREFACE:
        assert recorder.feed(bytes((byte,))) == []
    assert [f[0] for f in recorder.feed(frame(SETTINGS, 0, 0))] == [SETTINGS]


@pytest.mark.parametrize(("entry", "code"), [
    ((0x2, 2), PROTOCOL_ERROR), ((0x4, 2**31), FLOW_CONTROL_ERROR),
    ((0x5, 16383), PROTOCOL_ERROR), ((0x5, 1 << 24), PROTOCOL_ERROR),
])
def test_settings_values_are_checked(entry: tuple[int, int], code: int) -> None:
    with pytest.raises(H2ProtocolError) as caught:
        settings_entries(struct.pack(">HI", *entry))
    assert caught.value.code == code


def test_settings_unknown_identifiers_pass_through() -> None:
    payload = struct.pack(">HIHI", 0x4, 2**31 - 1, 0xFF, 7)
    assert settings_entries(payload) == [(0x4, 2**31 - 1), (0xFF, 7)]


def test_header_frames_cut_a_block_to_the_peer_frame_size() -> None:
    block = bytes(range(250)) * 100  # 25,000 bytes
    frames = read(b"".join(header_frames(5, block, True, 16384)))
    assert frames == [(HEADERS, END_STREAM | END_HEADERS, 5, block, 25_000 - 16384)]
    assert header_frames(5, b"ab", False, 16384) == [frame(HEADERS, END_HEADERS, 5, b"ab")]


def test_decoded_header_lists_are_capped() -> None:
    block = Encoder().encode([("x-big", "v" * 1000)])
    assert HeaderDecoder(2000).decode(block) == {"x-big": "v" * 1000}
    with pytest.raises(H2ProtocolError) as caught:
        HeaderDecoder(1000).decode(block)
    assert caught.value.code == ENHANCE_YOUR_CALM


def test_a_bad_block_is_a_compression_error() -> None:
    with pytest.raises(H2ProtocolError) as caught:
        HeaderDecoder(1 << 16).decode(b"\xff\xff\xff\xff\x7f")
    assert caught.value.code == COMPRESSION_ERROR


def test_cached_blocks_follow_the_hpack_table() -> None:
    decoder, encoder = HeaderDecoder(1 << 16), Encoder()
    first = [(":status", "200"), ("x-a", "1")]
    assert decoder.decode(encoder.encode(first)) == dict(first)  # x-a enters the table
    indexed = encoder.encode(first)
    assert decoder.decode(indexed) is decoder.decode(indexed)  # reused while the table stays
    assert decoder.decode(encoder.encode([("x-b", "2")])) == {"x-b": "2"}  # table changed
    # The same bytes now index a different dynamic entry: decoded afresh, not from the cache.
    assert decoder.decode(indexed) == {":status": "200", "x-b": "2"}


def test_only_small_blocks_are_kept_for_reuse() -> None:
    decoder = HeaderDecoder(1 << 16)
    small = hpack_literal("x-a", "1")
    big = hpack_literal("x-big", "v" * 8190)  # not indexed: the table stays as it was
    assert decoder.decode(big) == {"x-big": "v" * 8190}
    assert decoder.decode(big) is not decoder.decode(big)  # decoded afresh each time
    assert decoder.decode(small) is decoder.decode(small)


def test_values_decode_as_told() -> None:
    block = Encoder().encode([(b"grpc-message", "é".encode())])
    assert HeaderDecoder(1 << 16).decode(block) == {"grpc-message": "Ã©"}  # octets kept
    assert HeaderDecoder(1 << 16, "utf-8").decode(block) == {"grpc-message": "é"}


PING_FRAME = frame(PING, 0, 0, b"12345678")


@pytest.mark.parametrize("idle", [
    PING_FRAME, frame(SETTINGS, 0, 0), frame(PRIORITY, 0, 1, b"\x00" * 5),
    frame(0x20, 0, 0, b"unknown"), frame(DATA, 0, 1, b""),
])
def test_a_run_of_frames_that_carry_nothing_is_a_flood(idle: bytes) -> None:
    assert len(Recorder(max_idle_frames=3).started().feed(idle * 3)) == 3
    with pytest.raises(H2ProtocolError) as caught:
        Recorder(max_idle_frames=3).started().feed(idle * 4)
    assert caught.value.code == ENHANCE_YOUR_CALM


def test_frames_that_carry_something_end_a_run_and_neutral_ones_do_not() -> None:
    useful = [frame(DATA, 0, 1, b"x"), frame(DATA, END_STREAM, 1, b""),
              frame(HEADERS, END_HEADERS, 3, b"\x82"), frame(GOAWAY, 0, 0, b"\x00" * 8)]
    assert Recorder(max_idle_frames=3).started().feed(b"".join(PING_FRAME * 3 + f for f in useful))
    # Window updates, resets and the ACKs of our own PINGs and SETTINGS neither count nor reset.
    neutral = (frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x01")
               + frame(RST_STREAM, 0, 1, b"\x00" * 4) + frame(PING, ACK, 0, b"12345678")
               + frame(SETTINGS, ACK, 0))
    assert Recorder(max_idle_frames=3).started().feed(neutral * 10)
    with pytest.raises(H2ProtocolError) as caught:
        Recorder(max_idle_frames=3).started().feed(PING_FRAME * 2 + neutral + PING_FRAME * 2)
    assert caught.value.code == ENHANCE_YOUR_CALM


def test_goaway_and_ping_answers() -> None:
    [(kind, _, stream_id, payload, _)] = read(goaway_frame(7, ENHANCE_YOUR_CALM, "é" * 300))
    assert (kind, stream_id, goaway_fields(payload)) == (GOAWAY, 0, (7, ENHANCE_YOUR_CALM))
    assert len(payload) == 8 + 256  # the reason is cut short
    assert ping_ack(b"12345678") == frame(PING, ACK, 0, b"12345678")
