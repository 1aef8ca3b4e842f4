"""Helpers for the simulator tests: engines on the "tiny" profile, requests, collection."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvswitch.engine.base import GenerationRequest, GenerationUpdate, SamplingOptions
from kvswitch.engine.sim import SimConfig, SimEngine
from kvswitch.engine.sim.request import SimSequence

# Fast enough that a tiny-profile step (~1-3 ms simulated) costs only a yield.
FAST = 1e6


def make_engine(**overrides: object) -> SimEngine:
    fields: dict[str, object] = {"profile": "tiny", "time_scale": FAST, "mode": "echo"}
    fields.update(overrides)
    return SimEngine(SimConfig(**fields))  # type: ignore[arg-type]


def request(rid: str, prompt: list[int], **sampling: object) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingOptions(**sampling))  # type: ignore[arg-type]


def add(engine: SimEngine, rid: str, prompt: list[int], **sampling: object) -> list[SimSequence]:
    """Queue a request in the (not started) engine's scheduler, sans IO."""
    seqs = engine.make_sequences(request(rid, prompt, **sampling))
    for seq in seqs:
        engine.scheduler.add(seq)
    return seqs


def run_until_done(engine: SimEngine, limit: int = 100_000) -> list[float]:
    """Step the scheduler until idle; returns each step's simulated duration."""
    durations = []
    while engine.scheduler.has_work():
        durations.append(engine.scheduler.step().duration)
        assert len(durations) < limit, "scheduler made no progress"
    return durations


async def collect(updates: AsyncIterator[GenerationUpdate]) -> list[GenerationUpdate]:
    return [u async for u in updates]


def tokens_of(updates: list[GenerationUpdate], index: int = 0) -> list[int]:
    return [t for u in updates for d in u.sequences if d.index == index for t in d.token_ids]


def final_delta(updates: list[GenerationUpdate], index: int = 0):  # type: ignore[no-untyped-def]
    return next(d for u in updates for d in u.sequences if d.index == index and d.finish_reason)


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    e = make_engine()
    await e.start()
    yield e
    await e.stop()
