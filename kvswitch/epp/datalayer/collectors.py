"""Collectors: one refresh of one endpoint's load.

- `GrpcCollector` (h2c pools, over the pool's engine API: vLLM's or SGLang's, whose
  SchedulerLoad has the same fields): `GetLoads` every refresh, `HealthCheck` + `GetServerInfo` at
  most every `health_interval` seconds (and after any failure), over one HTTP/2 connection per
  endpoint (`kvswitch.protocol.h2client`, no grpc.aio poller thread). When that connection
  drops (the engine died or is going away) it calls `on_disconnect()` so the refresher can
  re-check the endpoint at once. Loads of several DP ranks are summed; kv usage =
  sum(num_used_tokens) / sum(max_total_num_tokens) when capacity is known, else the mean of
  `token_usage`.
- `PrometheusCollector` (http pools): `GET /metrics` over a plain asyncio stream (HTTP/1.1,
  `Connection: close`; httpx costs 2.5 times the CPU per scrape: docs/benchmarks/epp-cpu.md),
  read by prometheus_client's parser. vLLM names: vllm:num_requests_running,
  vllm:num_requests_waiting, vllm:kv_cache_usage_perc (older vllm:gpu_cache_usage_perc),
  vllm:cache_config_info {block_size, num_gpu_blocks}. Series with several label sets (models) are
  summed; kv usage takes the max.
Both call the endpoint over TLS when given an `UpstreamTls` (the gRPC one offering ALPN h2,
the Prometheus one http/1.1). A collector raises on any failure; the refresher marks the
endpoint failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from prometheus_client.parser import text_string_to_metric_families

from kvswitch.epp.datalayer.endpoint import Metrics
from kvswitch.protocol.engine_apis import engine_api
from kvswitch.protocol.h2client import H2Channel, StreamError
from kvswitch.tls import UpstreamTls, client_ssl_context, h2_channel_tls

USER_AGENT = "kvswitch-epp"


class CollectorError(Exception):
    """A refresh failed (endpoint unreachable, unhealthy or answering garbage)."""


class Collector(Protocol):
    async def collect(self, now: float) -> Metrics: ...

    async def close(self) -> None: ...


class GrpcCollector:
    def __init__(self, address: str, timeout: float = 1.0, health_interval: float = 1.0,
                 on_disconnect: Callable[[], None] | None = None, api: str = "vllm",
                 tls: UpstreamTls | None = None) -> None:
        self.address = address
        self.api = engine_api(api)
        self._health_path = self.api.path("HealthCheck")
        self._server_info_path = self.api.path("GetServerInfo")
        self._loads_path = self.api.path("GetLoads")
        self.timeout = timeout
        self.health_interval = health_interval
        self._channel = H2Channel.to(address, user_agent=USER_AGENT, on_lost=on_disconnect,
                                     **h2_channel_tls(tls))
        self._health_due = float("-inf")
        self._block_size = 0

    async def _check_health(self) -> None:
        api = self.api
        health = await self._channel.unary(
            self._health_path, api.health_request, api.parse_health, timeout=self.timeout)
        if not health.healthy:
            raise CollectorError(f"{self.address}: unhealthy: {health.message}")
        info = await self._channel.unary(
            self._server_info_path, api.server_info_request, api.parse_server_info,
            timeout=self.timeout)
        self._block_size = api.kv_granularity(info)

    async def collect(self, now: float) -> Metrics:
        try:
            if now >= self._health_due:
                await self._check_health()
                self._health_due = now + self.health_interval
            loads = await self._channel.unary(
                self._loads_path, self.api.loads_request, self.api.parse_loads,
                timeout=self.timeout)
        except StreamError as exc:
            self._health_due = float("-inf")  # re-check health as soon as it answers again
            raise CollectorError(f"{self.address}: {exc.code.name}: {exc.details}") from exc
        except CollectorError:
            self._health_due = float("-inf")
            raise
        running = waiting = used = capacity = waiting_tokens = 0
        usage_sum = 0.0
        for load in loads.loads:
            running += load.num_running_reqs
            waiting += load.num_waiting_reqs
            used += load.num_used_tokens
            capacity += load.max_total_num_tokens
            usage_sum += load.token_usage
            waiting_tokens += load.num_waiting_uncached_tokens
        if capacity:
            usage = used / capacity
        else:
            usage = usage_sum / len(loads.loads) if loads.loads else 0.0
        return Metrics(running=running, waiting=waiting, kv_usage=min(max(usage, 0.0), 1.0),
                       max_tokens=capacity, block_size=self._block_size, updated_at=now,
                       waiting_tokens=waiting_tokens)

    async def close(self) -> None:
        self._channel.close()


_WANTED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:gpu_cache_usage_perc", "vllm:cache_config_info")


def parse_prometheus(text: str, now: float) -> Metrics:
    """vLLM's Prometheus exposition -> Metrics (see module docstring)."""
    # Only the few series read here go to the parser: it costs ~10 us a line, and a vLLM's
    # /metrics holds hundreds of histogram lines.
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED))
    running = waiting = 0.0
    usage = 0.0
    block_size = num_blocks = 0
    seen = False
    try:
        samples = [s for family in text_string_to_metric_families(wanted) for s in family.samples]
    except ValueError as exc:
        raise CollectorError(f"unreadable /metrics: {exc}") from exc
    for sample in samples:
        if sample.name == "vllm:num_requests_running":
            running += sample.value
            seen = True
        elif sample.name == "vllm:num_requests_waiting":
            waiting += sample.value
        elif sample.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            usage = max(usage, sample.value)
        elif sample.name == "vllm:cache_config_info":
            block_size = _int_label(sample.labels, "block_size", block_size)
            num_blocks = _int_label(sample.labels, "num_gpu_blocks", num_blocks)
    if not seen:
        raise CollectorError("no vllm:num_requests_running in /metrics")
    return Metrics(running=int(running), waiting=int(waiting), kv_usage=min(max(usage, 0.0), 1.0),
                   max_tokens=block_size * num_blocks, block_size=block_size, updated_at=now)


def _int_label(labels: dict[str, str], key: str, default: int) -> int:
    raw = labels.get(key, "")
    return int(raw) if raw.isdigit() else default


class PrometheusCollector:
    def __init__(self, address: str, path: str = "/metrics", timeout: float = 1.0,
                 tls: UpstreamTls | None = None) -> None:
        self.address = address
        self._ssl = client_ssl_context(tls, alpn="http/1.1") if tls is not None else None
        self._server_hostname = tls.sni if tls is not None else None
        self.path = path
        self.timeout = timeout
        host, _, port = address.rpartition(":")
        self._host = host.strip("[]")
        self._port = int(port)

    async def _fetch(self) -> str:
        reader, writer = await asyncio.open_connection(
            self._host, self._port, ssl=self._ssl, server_hostname=self._server_hostname)
        try:
            writer.write(f"GET {self.path} HTTP/1.1\r\nHost: {self.address}\r\n"
                         "Accept: text/plain\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0].split()
        if len(status_line) < 2 or status_line[1] != b"200":
            raise CollectorError(f"{self.address}{self.path}: {head[:60]!r}")
        if b"transfer-encoding: chunked" in head.lower():
            body = _dechunk(body)
        return body.decode("utf-8", "replace")

    async def collect(self, now: float) -> Metrics:
        try:
            text = await asyncio.wait_for(self._fetch(), self.timeout)
        except (TimeoutError, OSError) as exc:
            raise CollectorError(f"{self.address}: {exc!r}") from exc
        return parse_prometheus(text, now)

    async def close(self) -> None:
        return None


def _dechunk(body: bytes) -> bytes:
    out = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2:]
    return bytes(out)
