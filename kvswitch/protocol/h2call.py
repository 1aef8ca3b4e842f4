"""One gRPC call of kvswitch's HTTP/2 client as its caller sees it: the messages received, how
it ended, cancelling it. `kvswitch.protocol.h2client`'s connection feeds it (`_receive`,
`_finish`); a call ended here (cancelled, past its deadline, a bad message, `on_message` said
stop) resets its stream through its owner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import grpc

__all__ = ["CallOwner", "MessageCallback", "NotAccepted", "StreamCall", "StreamError"]


class StreamError(Exception):
    """A call that ended with a non-OK gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class NotAccepted(StreamError):
    """This channel cannot take the call now (no connection, window or stream slot)."""

    def __init__(self, details: str = "call not accepted") -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details)


class CallOwner(Protocol):
    """What a call needs of its connection."""

    loop: asyncio.AbstractEventLoop
    calls: dict[int, StreamCall]

    def reset(self, stream_id: int) -> None: ...


class StreamCall:
    """One call's received messages; `read_batch()` returns all those waiting."""

    __slots__ = ("_conn", "_ended", "_error", "_id", "_messages", "_on_message", "_parse",
                 "_timer", "_waiter")

    def __init__(self, conn: CallOwner, stream_id: int, parse: Callable[[bytes], Any],
                 on_message: MessageCallback | None = None) -> None:
        self._conn, self._id, self._parse = conn, stream_id, parse
        self._on_message = on_message
        self._messages: list[Any] = []
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._error: Exception | None = None
        """A `StreamError`, or what `on_message` raised."""
        self._timer: asyncio.TimerHandle | None = None

    async def read_batch(self) -> list[Any]:
        """The messages received so far (at least one), or [] once the call ended OK;
        raises `StreamError` when it ended otherwise."""
        while not self._messages:
            if self._ended:
                if self._error is None:
                    return []
                raise self._error
            await self._wait()
        messages, self._messages = self._messages, []
        return messages

    async def ended(self) -> None:
        """Wait until the call ends: returns when it ended OK, raises `StreamError` when it
        ended otherwise, or what `on_message` raised (which ended it)."""
        while not self._ended:
            await self._wait()
        if self._error is not None:
            raise self._error

    async def response(self) -> Any:
        """A unary call's one response, once the call ended OK; raises `StreamError` when it
        ended otherwise. Cancelling the caller cancels the call."""
        try:
            while not self._ended:
                await self._wait()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if self._error is not None:
            raise self._error
        if len(self._messages) != 1:
            raise StreamError(grpc.StatusCode.INTERNAL,
                              f"unary call answered {len(self._messages)} messages")
        return self._messages[0]

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def cancel(self) -> None:
        """Reset the stream (the server aborts the request); a no-op once it ended."""
        self._fail(StreamError(grpc.StatusCode.CANCELLED, "cancelled by the client"))

    def _expire(self) -> None:
        self._fail(StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))

    # --- fed by the connection -------------------------------------------------------------

    def _receive(self, messages: list[bytes]) -> None:
        out = self._messages
        error: StreamError | None = None
        try:
            out.extend(map(self._parse, messages))  # those before a bad message stay in `out`
        except Exception as exc:  # noqa: BLE001 - a bad message fails its call, not the others
            error = StreamError(grpc.StatusCode.INTERNAL, f"bad response message: {exc}")
        if self._on_message is not None and out:
            self._dispatch()  # those before a bad message still count
        if error is not None:
            self._fail(error)
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _dispatch(self) -> None:
        """Hand the messages received to `on_message`, in order, until it says stop."""
        on_message = self._on_message
        assert on_message is not None
        messages, self._messages = self._messages, []
        for message in messages:
            try:
                go_on = on_message(message)
            except Exception as exc:  # noqa: BLE001 - the owner's error ends its call;
                # ended() raises it
                self._fail(exc)
                return
            if not go_on:
                self.cancel()
                return

    def _fail(self, error: Exception) -> None:
        """End the call here and reset its stream."""
        if not self._ended:
            self._finish(error)
            self._conn.reset(self._id)

    def _finish(self, error: Exception | None) -> None:
        if not self._ended:
            self._ended, self._error = True, error
            self._conn.calls.pop(self._id, None)
            if self._timer is not None:
                self._timer.cancel()
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


MessageCallback = Callable[[Any], bool]
"""Takes one parsed message as it arrives; returns False to end the call (it is cancelled)."""
