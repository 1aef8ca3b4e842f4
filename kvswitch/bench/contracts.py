"""The bench target contract: what the runner drives and every target implements.

A `Target` stands between the load generator and the engine pool. `start(ctx)` brings it up
over the pool in a `RunContext` (or raises `TargetUnavailable` with the reason), `choose` names
the gRPC address each request goes to, `first_token` / `finished` report each request's
progress, `stop` ends what `start` started. A target that speaks OpenAI HTTP instead of gRPC
also has `send_request` (see `kvswitch.bench.smg`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvswitch.bench.client import RequestResult
from kvswitch.bench.engines import EnginePool
from kvswitch.bench.workloads import BenchRequest
from kvswitch.supervisor import Supervisor


class TargetUnavailable(Exception):
    """The target cannot run on this machine; the message says why."""


@dataclass
class RunContext:
    supervisor: Supervisor
    pool: EnginePool
    state_dir: Path


class Target(Protocol):
    name: str
    text_prompts: bool

    async def start(self, ctx: RunContext) -> None: ...

    def choose(self, request: BenchRequest) -> tuple[str, str]:
        """(gRPC address to send to, engine label if the target knows it, else "")."""
        ...

    def addresses(self) -> list[str]:
        """Every gRPC address `choose` may return (connected before the run starts)."""
        ...

    def first_token(self, request: BenchRequest) -> None: ...

    def finished(self, request: BenchRequest, result: RequestResult) -> None: ...

    async def stop(self) -> None: ...
