"""One grpc.aio channel to the target (Envoy's listener or an engine) and the calls made on it.

The channel is created lazily on the running event loop, so a worker process forked or spawned
by `kvswitch frontend --workers N` builds its own (gRPC channels do not survive a fork).
gRPC failures become kvswitch errors here, at the boundary (`error_from_rpc`).

Generate, the per-token hot path, goes over `h2client.H2Channel` (a lean HTTP/2 client) when
the target is a list of addresses; the other calls, and any Generate that channel cannot take
(no connection, a request larger than the peer's window), use grpc.aio. Both hand back a
`GenerateStream`: `read_batch()` returns every response already received.
"""

from __future__ import annotations

import asyncio
import io
import logging
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import grpc
import grpc.aio

from kvswitch.errors import (
    Cancelled,
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    KvswitchError,
    NotFound,
    RateLimited,
    Unavailable,
    Unimplemented,
)
from kvswitch.limits import MAX_TOKENIZER_ARCHIVE_BYTES
from kvswitch.protocol import common_pb2, vllm_engine_pb2_grpc
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.h2client import H2Channel, NotAccepted, StreamError, parse_target
from kvswitch.protocol.h2client import available as h2_available
from kvswitch.tls import UpstreamTls, client_ssl_context, grpc_channel_credentials

__all__ = ["EngineClient", "GenerateStream", "Metadata", "error_from_rpc", "error_from_status"]

Metadata = Sequence[tuple[str, str]]

logger = logging.getLogger(__name__)

_BY_CODE: dict[grpc.StatusCode, type[KvswitchError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimited,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
}

# Large prompts and embeddings: lift gRPC's 4 MiB default.
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.http2.max_pings_without_data", 0),
    # Envoy or an engine restarting: reconnect quickly rather than after the default backoff.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # A target naming several engines ("ipv4:127.0.0.1:5001,127.0.0.1:5002") is spread over
    # them; a single address (Envoy, one engine) is unaffected.
    ("grpc.lb_policy_name", "round_robin"),
]


_GENERATE_PATH = "/vllm.grpc.engine.VllmEngine/Generate"


def error_from_status(code: grpc.StatusCode, details: str, what: str = "the engine"
                      ) -> KvswitchError:
    """The kvswitch error with the same meaning as a gRPC status."""
    details = details or code.name
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"{what} is unavailable: {details}"
    return _BY_CODE.get(code, InternalError)(details)


def error_from_rpc(exc: grpc.aio.AioRpcError | StreamError, what: str = "the engine"
                   ) -> KvswitchError:
    """Translate a failed call into the kvswitch error with the same meaning."""
    if isinstance(exc, StreamError):
        return error_from_status(exc.code, exc.details, what)
    return error_from_status(exc.code(), exc.details() or "", what)


class GenerateStream(Protocol):
    async def read_batch(self) -> list[pb.GenerateResponse]:
        """Every response received so far (at least one); [] once the call ended OK. Raises
        `StreamError` or `grpc.aio.AioRpcError` when it failed."""
        ...

    def cancel(self) -> None:
        """Stop the call (the engine aborts the request); a no-op once it ended."""
        ...


class _AioStream:
    """A grpc.aio call behind the `GenerateStream` interface (one response per batch)."""

    __slots__ = ("_call",)

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    async def read_batch(self) -> list[pb.GenerateResponse]:
        message = await self._call.read()
        return [] if message is grpc.aio.EOF else [message]

    def cancel(self) -> None:
        self._call.cancel()


class EngineClient:
    """The VllmEngine calls the frontend makes, on one channel per process."""

    def __init__(self, target: str, tls: UpstreamTls | None = None) -> None:
        self.target = target
        self.tls = tls
        """Call the target over TLS (mTLS with a client certificate); None: h2c."""
        self._channel: grpc.aio.Channel | None = None
        self._stub: vllm_engine_pb2_grpc.VllmEngineStub | None = None
        addresses = parse_target(target)
        self._h2 = (H2Channel(addresses, ssl=client_ssl_context(tls) if tls else None,
                              server_hostname=tls.sni if tls else None)
                    if addresses and h2_available() else None)
        if addresses and self._h2 is None:
            logger.warning("the hpack package is not installed: Generate uses grpc.aio "
                           "(about 3x the CPU per streamed token)")

    @property
    def stub(self) -> vllm_engine_pb2_grpc.VllmEngineStub:
        if self._stub is None:
            if self.tls is None:
                self._channel = grpc.aio.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
            else:
                self._channel = grpc.aio.secure_channel(
                    self.target, grpc_channel_credentials(self.tls),
                    options=[*_CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", self.tls.sni)])
            self._stub = vllm_engine_pb2_grpc.VllmEngineStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._h2 is not None:
            self._h2.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub = None, None

    async def generate(self, request: pb.GenerateRequest, metadata: Metadata
                       ) -> GenerateStream:
        """Start a Generate call; the caller reads it and must `cancel()` it if it stops
        early (a client that went away), which makes the engine abort the request at once."""
        if self._h2 is not None:
            try:
                return await self._h2.start(_GENERATE_PATH, metadata,
                                            request.SerializeToString(),
                                            pb.GenerateResponse.FromString)
            except NotAccepted:
                pass
        return _AioStream(self.stub.Generate(request, metadata=tuple(metadata)))

    async def embed(self, request: pb.EmbedRequest, metadata: Metadata) -> pb.EmbedResponse:
        try:
            response: pb.EmbedResponse = await self.stub.Embed(request, metadata=tuple(metadata))
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from exc
        return response

    async def model_info(self, timeout: float = 5.0) -> pb.GetModelInfoResponse:
        try:
            info: pb.GetModelInfoResponse = await self.stub.GetModelInfo(
                pb.GetModelInfoRequest(), timeout=timeout, wait_for_ready=False)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, f"the target {self.target}") from exc
        return info

    async def health(self, timeout: float = 2.0) -> bool:
        try:
            reply = await self.stub.HealthCheck(pb.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.healthy)

    async def fetch_tokenizer(self, timeout: float = 60.0) -> Path | None:
        """Download the target's tokenizer archive into a temporary directory; None if the
        target does not serve GetTokenizer."""
        data = io.BytesIO()
        try:
            call = self.stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=timeout)
            async for chunk in call:
                data.write(chunk.data)
                if data.tell() > MAX_TOKENIZER_ARCHIVE_BYTES:
                    call.cancel()
                    raise InternalError(f"the target's tokenizer archive is over "
                                        f"{MAX_TOKENIZER_ARCHIVE_BYTES} bytes")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise error_from_rpc(exc, f"the target {self.target}") from exc
        return await asyncio.to_thread(_unzip, data.getvalue())


def _unzip(data: bytes) -> Path:
    directory = Path(tempfile.mkdtemp(prefix="kvswitch-tokenizer-"))
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
                if name in archive.namelist():
                    # Read no more than the limit, whatever size the archive declares.
                    with archive.open(name) as member:
                        content = member.read(MAX_TOKENIZER_ARCHIVE_BYTES + 1)
                    if len(content) > MAX_TOKENIZER_ARCHIVE_BYTES:
                        raise InternalError(f"the target's {name} inflates past "
                                            f"{MAX_TOKENIZER_ARCHIVE_BYTES} bytes")
                    (directory / name).write_bytes(content)
    except zipfile.BadZipFile as exc:
        raise InternalError(f"the target sent a tokenizer archive that is not a zip: {exc}") \
            from exc
    return directory
