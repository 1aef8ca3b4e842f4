"""The engine process: grpc.aio server (VllmEngine, or SglangScheduler with `api="sglang"`;
grpc.health.v1, reflection), the /metrics HTTP server, and graceful shutdown.

Shutdown (SIGTERM/SIGINT or `stop()`): health goes NOT_SERVING, KV-event subscriptions end,
the gRPC server stops accepting RPCs, in-flight ones get `grace` seconds to finish, then the
rest are cancelled (which aborts them in the engine) and the engine stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvswitch.engine.base import Engine
from kvswitch.engine.metrics import EngineMetrics
from kvswitch.engine.registration import add_engine_servicer
from kvswitch.engine.servicer import VllmEngineServicer
from kvswitch.engine.sglang_servicer import SglangSchedulerServicer
from kvswitch.limits import MESSAGE_DEFAULTS, SAMPLING_DEFAULTS, MessageLimits, SamplingLimits
from kvswitch.metrics_http import MetricsHttpServer
from kvswitch.protocol import SERVICE_NAME
from kvswitch.tls import TlsFiles, grpc_server_credentials, grpc_server_options
from kvswitch.tokenization import TokenizerBundle

logger = logging.getLogger(__name__)

_MiB = 1024 * 1024
GRPC_OPTIONS: list[tuple[str, int]] = [
    # Embeddings of long prompts exceed gRPC's 4 MiB default. The receive limit comes from
    # `MessageLimits` (grpc core applies it to a compressed message's inflated size too).
    ("grpc.max_send_message_length", 256 * _MiB),
    # Fail on a port someone else holds instead of silently sharing it.
    ("grpc.so_reuseport", 0),
    # Proxies (Envoy) keep long-lived HTTP/2 connections with pings; allow them.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_concurrent_streams", 10_000),
]
_HEALTH_POLL_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int | None = None
    """Port of /metrics and /health; None: no HTTP server."""
    grace_period: float = 30.0
    tokenizer_dir: str | None = None
    description: str = ""
    """Extra words for the startup log line (profile, time scale)."""
    sampling_limits: SamplingLimits = SAMPLING_DEFAULTS
    message_limits: MessageLimits = MESSAGE_DEFAULTS
    api: str = "vllm"
    """The gRPC API served: "vllm" (VllmEngine) or "sglang" (SglangScheduler)."""
    page_size: int = 1
    """api "sglang": the radix cache's page size its KV events report (divides block_size)."""
    tls: TlsFiles | None = None
    """Serve gRPC over TLS (mTLS with a client CA); None: plaintext."""


class EngineServer:
    """One engine served over gRPC (and HTTP for metrics); start(), then stop() or
    run_until_signal()."""

    def __init__(self, engine: Engine, tokenizer: TokenizerBundle, options: ServerOptions):
        self.engine = engine
        self.options = options
        self.metrics = EngineMetrics(engine)
        self.servicer: VllmEngineServicer | SglangSchedulerServicer
        if options.api == "sglang":
            self.servicer = SglangSchedulerServicer(
                engine, tokenizer, page_size=options.page_size,
                tokenizer_dir=options.tokenizer_dir, metrics=self.metrics)
        else:
            self.servicer = VllmEngineServicer(
                engine, tokenizer, tokenizer_dir=options.tokenizer_dir, metrics=self.metrics,
                limits=options.sampling_limits)
        self.service_name = SERVICE_NAME
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=[
            *GRPC_OPTIONS, *grpc_server_options(options.tls),
            ("grpc.max_receive_message_length", options.message_limits.max_message_bytes)])
        self.http = MetricsHttpServer(self.metrics.render, self._serving)
        self.port = 0
        self.http_port = 0
        self._stopped = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None

    def _serving(self) -> bool:
        return self.engine.is_healthy() and not self.servicer.draining.is_set()

    async def start(self) -> int:
        """Start the engine and both servers; returns the bound gRPC port. Raises OSError when
        a port cannot be bound, after undoing whatever had started."""
        self.service_name = add_engine_servicer(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (self.service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        try:
            # The gRPC port first, so that clash fails before the engine starts its scheduler.
            # A /metrics clash comes after gRPC started (grpc.aio only releases a port it
            # served), so it is undone below; health says SERVING only once both are bound.
            self._bind_grpc()
            await self.engine.start()
            await self.server.start()
            await self._start_http()
        except BaseException:
            await self._undo_start()
            raise
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._health_task = asyncio.create_task(self._follow_engine_health())
        self._log_started()
        return self.port

    def _bind_grpc(self) -> None:
        address = f"{self.options.host}:{self.options.port}"
        try:
            if self.options.tls is not None:
                self.port = self.server.add_secure_port(
                    address, grpc_server_credentials(self.options.tls))
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc reports a port in use this way
            raise OSError(f"cannot bind the gRPC server to {address} (in use?)") from exc
        if self.port == 0:
            raise OSError(f"cannot bind the gRPC server to {address}")

    async def _start_http(self) -> None:
        if self.options.http_port is None:
            return
        address = f"{self.options.host}:{self.options.http_port}"
        try:
            await self.http.start(self.options.host, self.options.http_port)
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise OSError(f"cannot bind the /metrics HTTP server to {address}: {reason}") from exc
        self.http_port = self.http.port

    async def _undo_start(self) -> None:
        # A grpc.aio server dropped without stop() complains from __del__ once the loop closed.
        await self.server.stop(None)
        await self.engine.stop()
        await self.http.stop()

    def _log_started(self) -> None:
        card = self.engine.model
        logger.info("kvswitch engine serving %s on %s:%d (gRPC%s) %s; max_model_len=%d, "
                    "block_size=%d, num_gpu_blocks=%d, max_num_seqs=%d",
                    card.served_model_name, self.options.host, self.port,
                    f", metrics on :{self.http_port}/metrics" if self.http_port else "",
                    self.options.description, card.max_model_len, card.block_size,
                    card.num_gpu_blocks, card.max_num_seqs)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for service in ("", self.service_name):
            await self.health.set(service, status)

    async def _follow_engine_health(self) -> None:
        # gRPC health mirrors engine liveness until shutdown takes it over.
        serving = True
        while not self.servicer.draining.is_set():
            await asyncio.sleep(_HEALTH_POLL_SECONDS)
            now = self._serving()
            if now != serving and not self.servicer.draining.is_set():
                serving = now
                await self._set_health(health_pb2.HealthCheckResponse.SERVING if now
                                       else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop (idempotent)."""
        if self.servicer.draining.is_set():
            await self._stopped.wait()
            return
        grace = self.options.grace_period if grace is None else grace
        self.servicer.draining.set()
        await self.health.enter_graceful_shutdown()
        logger.info("Draining: NOT_SERVING; waiting up to %.1f s for %d in-flight request(s)",
                    grace, self.servicer.active_requests)
        await self.server.stop(grace)
        logger.info("gRPC server stopped")
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.engine.stop()
        logger.info("Engine stopped")
        await self.http.stop()
        logger.info("Shutdown complete")
        self._stopped.set()

    async def run_until_signal(self) -> None:
        """Serve until SIGTERM or SIGINT, then stop gracefully."""
        loop = asyncio.get_running_loop()
        requested = asyncio.Event()

        def on_signal(sig: signal.Signals) -> None:
            if not requested.is_set():
                logger.info("Received %s, shutting down", sig.name)
            requested.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await requested.wait()
            await self.stop()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
