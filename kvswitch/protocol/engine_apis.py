"""The engine gRPC APIs a pool may speak, as the EPP's telemetry calls them.

A pool is one API (`api` on its endpoints): "vllm" (`vllm.grpc.engine.VllmEngine`) or "sglang"
(`sglang.grpc.scheduler.SglangScheduler`). Both answer HealthCheck, GetServerInfo, GetLoads and
SubscribeKvEvents with the same shapes where it matters (SchedulerLoad's fields, the common
KvEventBatch); `EngineApi` holds each one's paths, requests and response parsers, and where the
engine states its KV granularity (vLLM: GetServerInfo.block_size; SGLang: the radix cache's
page size, server_args["page_size"]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvswitch.protocol import SERVICE_NAME, vllm_engine_pb2
from kvswitch.protocol.sglang import SGLANG_SERVICE_NAME, sglang_scheduler_pb2

__all__ = ["EngineApi", "engine_api"]


@dataclass(frozen=True, slots=True)
class EngineApi:
    name: str
    service: str
    health_request: bytes
    parse_health: Callable[[bytes], Any]
    server_info_request: bytes
    parse_server_info: Callable[[bytes], Any]
    loads_request: bytes
    parse_loads: Callable[[bytes], Any]
    kv_granularity: Callable[[Any], int]
    """A GetServerInfo answer -> the tokens per KV event block (0: not stated)."""

    def path(self, method: str) -> str:
        return f"/{self.service}/{method}"


def _sglang_page_size(info: Any) -> int:
    value = info.server_args.fields.get("page_size")
    return int(value.number_value) if value is not None else 0


_VLLM = EngineApi(
    "vllm", SERVICE_NAME,
    vllm_engine_pb2.HealthCheckRequest().SerializeToString(),
    vllm_engine_pb2.HealthCheckResponse.FromString,
    vllm_engine_pb2.GetServerInfoRequest().SerializeToString(),
    vllm_engine_pb2.GetServerInfoResponse.FromString,
    vllm_engine_pb2.GetLoadsRequest().SerializeToString(),
    vllm_engine_pb2.GetLoadsResponse.FromString,
    lambda info: int(info.block_size),
)
_SGLANG = EngineApi(
    "sglang", SGLANG_SERVICE_NAME,
    sglang_scheduler_pb2.HealthCheckRequest().SerializeToString(),
    sglang_scheduler_pb2.HealthCheckResponse.FromString,
    sglang_scheduler_pb2.GetServerInfoRequest().SerializeToString(),
    sglang_scheduler_pb2.GetServerInfoResponse.FromString,
    # Only the routing core: SGLang's default ("all") gathers every section.
    sglang_scheduler_pb2.GetLoadsRequest(include=["core"]).SerializeToString(),
    sglang_scheduler_pb2.GetLoadsResponse.FromString,
    _sglang_page_size,
)
_APIS = {api.name: api for api in (_VLLM, _SGLANG)}


def engine_api(name: str) -> EngineApi:
    """The API called `name` ("vllm" or "sglang"); ValueError for any other."""
    try:
        return _APIS[name]
    except KeyError:
        raise ValueError(f"unknown engine API {name!r}: expected one of "
                         f"{', '.join(_APIS)}") from None
