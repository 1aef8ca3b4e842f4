"""Routers for EPP tests: the real one built from a config with loads set by hand, and fakes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.config import build_endpoint_picker, static_pool
from kvswitch.epp.contracts import (
    InferenceRequest,
    ParsedBody,
    RequestOutcome,
    RoutingDecision,
)
from kvswitch.epp.datalayer import Metrics
from kvswitch.epp.metrics import EppMetrics
from kvswitch.epp.router import EppRouter

ADDRS = [f"127.0.0.1:{9000 + i}" for i in range(4)]


def config(**extra: Any) -> dict[str, Any]:
    return {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig", **extra}


def make_router(cfg: Mapping[str, Any] | None = None, addrs: list[str] = ADDRS,
                objectives: list[dict[str, Any]] | None = None) -> EppRouter:
    router = build_endpoint_picker(cfg, [*static_pool(addrs), *(objectives or [])],
                                   metrics=EppMetrics()).router
    assert isinstance(router, EppRouter)
    router.datalayer.set_endpoints(router.refresher.discovery.endpoints)  # type: ignore[union-attr]
    router.datalayer.staleness = 1e9
    for a in addrs:
        set_load(router, a)
    return router


def set_load(router: EppRouter, address: str, **metrics: Any) -> None:
    router.datalayer.update(address, Metrics(updated_at=router.datalayer.clock(), **metrics))


_ids = iter(range(10**9))


def request(tokens: tuple[int, ...], objective: str | None = None,
            fairness_id: str = "default-flow") -> InferenceRequest:
    return InferenceRequest(f"r{next(_ids)}", "grpc", "/p", ParsedBody(prompt_token_ids=tokens),
                            objective=objective, fairness_id=fairness_id)


def prompt(seed: int, n: int = 1024) -> tuple[int, ...]:
    rnd = random.Random(seed)
    return tuple(rnd.randrange(150_000) for _ in range(n))


class NoBackground:
    """The real router's route/finish, without its refresher (the test sets the load)."""

    def __init__(self, router: EppRouter) -> None:
        self.router = router

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def route(self, req: InferenceRequest, subset: Sequence[str] | None) -> RoutingDecision:
        return await self.router.route(req, subset)

    def request_finished(self, req: InferenceRequest, outcome: RequestOutcome) -> None:
        self.router.request_finished(req, outcome)


class FakeRouter:
    def __init__(self, decision: RoutingDecision | None = None, fail: bool = False) -> None:
        self.decision = decision or RoutingDecision(endpoints=("10.0.0.1:8000",))
        self.fail = fail
        self.started = self.stopped = False
        self.routed: list[tuple[InferenceRequest, Sequence[str] | None]] = []
        self.finished: list[tuple[InferenceRequest, RequestOutcome]] = []
        self.finished_event = asyncio.Event()

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def route(self, request: InferenceRequest,
                    subset: Sequence[str] | None) -> RoutingDecision:
        if self.fail:
            raise RuntimeError("scheduler exploded")
        self.routed.append((request, subset))
        return self.decision

    def request_finished(self, request: InferenceRequest, outcome: RequestOutcome) -> None:
        self.finished.append((request, outcome))
        self.finished_event.set()
