"""SGLang's gRPC scheduler API (`sglang.grpc.scheduler.SglangScheduler`, from `smg-grpc-proto`).

The same generated stubs SGLang's own gRPC server and SMG's workers use. `API_NAMES` are the
values a pool's `api` setting (and `--api` options) take: a pool speaks one of them.
"""

from __future__ import annotations

from smg_grpc_proto.generated import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

__all__ = [
    "API_NAMES",
    "SGLANG_EMBED_PATH",
    "SGLANG_GENERATE_PATH",
    "SGLANG_SERVICE_NAME",
    "sglang_method_path",
    "sglang_scheduler_pb2",
    "sglang_scheduler_pb2_grpc",
]

SGLANG_SERVICE_NAME = "sglang.grpc.scheduler.SglangScheduler"
API_NAMES = ("vllm", "sglang")
"""vllm: `vllm.grpc.engine.VllmEngine`; sglang: `sglang.grpc.scheduler.SglangScheduler`."""


def sglang_method_path(method: str) -> str:
    """The HTTP/2 `:path` of a SglangScheduler method."""
    return f"/{SGLANG_SERVICE_NAME}/{method}"


SGLANG_GENERATE_PATH = sglang_method_path("Generate")
SGLANG_EMBED_PATH = sglang_method_path("Embed")
