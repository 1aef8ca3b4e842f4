"""The connection-level HTTP/2 state both transports share (`kvswitch.protocol.h2state`):
SETTINGS applied, the connection windows both ways, exact frames out, errors by code."""

from __future__ import annotations

import struct

import pytest

from kvswitch.protocol.h2state import ConnectionState
from kvswitch.protocol.http2 import (
    FLOW_CONTROL_ERROR,
    MAX_WINDOW,
    PROTOCOL_ERROR,
    SETTINGS,
    WINDOW_UPDATE,
    H2ProtocolError,
    frame,
)


def settings(**values: int) -> bytes:
    keys = {"max_streams": 0x3, "initial_window": 0x4, "max_frame": 0x5}
    return b"".join(struct.pack(">HI", keys[k], v) for k, v in values.items())


def test_initiate_sends_settings_and_opens_the_connection_window() -> None:
    state = ConnectionState()
    assert state.initiate(initial_window=1 << 20, max_header_list=4096) == (
        frame(SETTINGS, 0, 0, struct.pack(">HIHIHIHI", 0x2, 0, 0x4, 1 << 20, 0x5, 1 << 20,
                                          0x6, 4096))
        + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - 65535)))
    assert state.recv_window == MAX_WINDOW
    # A server's SETTINGS name its stream limit too, second as before.
    assert ConnectionState().initiate(initial_window=1, max_header_list=2,
                                      max_concurrent_streams=3)[9:21] == struct.pack(
        ">HIHI", 0x2, 0, 0x3, 3)


def test_settings_are_applied_and_the_window_change_reported() -> None:
    state = ConnectionState()
    assert state.on_settings(settings(initial_window=100_000, max_frame=32768,
                                      max_streams=7)) == 100_000 - 65535
    assert (state.peer_initial_window, state.peer_max_frame, state.peer_max_streams) == (
        100_000, 32768, 7)
    assert state.on_settings(settings(initial_window=10)) == 10 - 100_000
    assert state.on_settings(b"") == 0


def test_window_updates_grow_the_send_window_within_bounds() -> None:
    state = ConnectionState()
    state.on_window_update(struct.pack(">I", 0x80000000 | 35))  # the reserved bit is ignored
    assert state.send_window == 65535 + 35
    with pytest.raises(H2ProtocolError) as caught:
        state.on_window_update(struct.pack(">I", 0))
    assert caught.value.code == PROTOCOL_ERROR
    with pytest.raises(H2ProtocolError) as caught:
        state.on_window_update(struct.pack(">I", MAX_WINDOW))
    assert caught.value.code == FLOW_CONTROL_ERROR


def test_inbound_data_is_held_to_the_window_and_refilled_once_due() -> None:
    state = ConnectionState(refill_at=100)
    state.received(60)
    assert state.refill() == b""
    state.received(50)
    assert state.refill() == frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 110))
    assert (state.recv_window, state.recv_unacked) == (65535, 0)
    with pytest.raises(H2ProtocolError) as caught:
        state.received(65536)
    assert caught.value.code == FLOW_CONTROL_ERROR
