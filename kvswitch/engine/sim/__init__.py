"""The vLLM simulator backend: an `Engine` whose GPU is a step-time model (docs/simulator.md).

    from kvswitch.engine.sim import SimEngine, SimConfig, PROFILES
    engine = SimEngine(SimConfig(profile="tiny", time_scale=1000, mode="echo"))
    await engine.start(); ...; await engine.stop()

Modules, one concern each: `roofline` (step time and KV capacity from model and GPU configs),
`catalog` (the bundled configs), `profiles` (named deployments, step model + KV geometry),
`kv_cache` (paged, hash-chained prefix cache with LRU eviction and events), `scheduler` (vLLM V1
continuous batching, chunked prefill, preemption), `sampler` (tokens, logprobs, stop rules),
`clock` (simulated time and pacing), `output` (merge-when-behind delivery), `events` (KV event
batches and replay), `engine` (the asyncio loop and the `Engine` contract).
"""

from __future__ import annotations

from kvswitch.engine.sim.config import FAILURE_KINDS, MODES, SimConfig
from kvswitch.engine.sim.engine import SimEngine
from kvswitch.engine.sim.profiles import PROFILES, STEP_MODELS, SimProfile, get_profile

__all__ = [
    "FAILURE_KINDS",
    "MODES",
    "PROFILES",
    "STEP_MODELS",
    "SimConfig",
    "SimEngine",
    "SimProfile",
    "get_profile",
]
