"""One grpc.aio channel to the target (Envoy's listener or an engine) and the calls made on it.

The channel is created lazily on the running event loop, so a worker process forked or spawned
by `kvswitch frontend --workers N` builds its own (gRPC channels do not survive a fork).
gRPC failures become kvswitch errors here, at the boundary (`error_from_rpc`).
"""

from __future__ import annotations

import asyncio
import io
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

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
from kvswitch.protocol import common_pb2, vllm_engine_pb2 as pb, vllm_engine_pb2_grpc

__all__ = ["EngineClient", "error_from_rpc", "Metadata"]

Metadata = Sequence[tuple[str, str]]

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


def error_from_rpc(exc: grpc.aio.AioRpcError, what: str = "the engine") -> KvswitchError:
    """Translate a failed call into the kvswitch error with the same meaning."""
    code = exc.code()
    details = exc.details() or code.name
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"{what} is unavailable: {details}"
    return _BY_CODE.get(code, InternalError)(details)


class EngineClient:
    """The VllmEngine calls the frontend makes, on one channel per process."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._channel: grpc.aio.Channel | None = None
        self._stub: vllm_engine_pb2_grpc.VllmEngineStub | None = None

    @property
    def stub(self) -> vllm_engine_pb2_grpc.VllmEngineStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
            self._stub = vllm_engine_pb2_grpc.VllmEngineStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub = None, None

    def generate(self, request: pb.GenerateRequest, metadata: Metadata,
                 timeout: float | None = None) -> grpc.aio.UnaryStreamCall:
        """Start a Generate call; the caller iterates it and must `cancel()` it if it stops
        early (a client that went away), which makes the engine abort the request at once."""
        call: grpc.aio.UnaryStreamCall = self.stub.Generate(request, metadata=tuple(metadata),
                                                            timeout=timeout)
        return call

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
                    (directory / name).write_bytes(archive.read(name))
    except zipfile.BadZipFile as exc:
        raise InternalError(f"the target sent a tokenizer archive that is not a zip: {exc}") \
            from exc
    return directory
