"""The vLLM gRPC engine API (from `smg-grpc-proto`, as vLLM uses it) and protocol constants."""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

__all__ = [
    "EMBED_PATH",
    "GENERATE_PATH",
    "SERVICE_NAME",
    "common_pb2",
    "method_path",
    "vllm_engine_pb2",
    "vllm_engine_pb2_grpc",
]

SERVICE_NAME = "vllm.grpc.engine.VllmEngine"


def method_path(method: str) -> str:
    """The HTTP/2 `:path` of a VllmEngine method, e.g. `/vllm.grpc.engine.VllmEngine/Generate`."""
    return f"/{SERVICE_NAME}/{method}"


GENERATE_PATH = method_path("Generate")
EMBED_PATH = method_path("Embed")
