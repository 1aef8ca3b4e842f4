"""The fleet simulator: N simulated engines and a router under test, in virtual time.

Entry point: `run_fleet(workload, router, profile, replicas, ...) -> FleetResult`
(`fleet.sim`). Each replica is the simulator's own `Scheduler` + `KvCacheManager` built from a
`SimProfile` (`fleet.replica`), stepped by a discrete-event loop: a step lasts the duration
`Scheduler.step()` returns (the profile's step model, whatever it is), KV events are coalesced
per the engine's window (50 ms) and handed to the router with its own delivery delay. Routers
(`make_router(name)`):
- an EPP config (`epp:PATH`, `epp:NAME` for a bundled `kvswitch/bench/configs/NAME.yaml`, or
  `kvswitch` for `kvswitch up`'s DEFAULT_EPP_CONFIG): the real plugins and router code
  (`fleet.epp`); with `@N` appended (`kvswitch@3`), N such EPPs side by side, each routing
  every N-th request (`fleet.multi_epp`);
- `round-robin`, `random`, `oracle` (the bench's greedy oracle), `oracle-conserve`,
  `oracle-lookahead` (variants), `smg-cache-aware-model` and `smg-cache-aware-tree-model`
  (models of SMG's policy with and without KV events) (`fleet.routers`).
`oracle-best` is not a router but a reference: the best of the oracle variants (`best_of`), per
stage by engine-side TTFT p90.

Results are engine-side, as `kvswitch bench` reports them from the engines' request logs
(`kvswitch.bench.engine_report`): TTFT p50/p90/p99, queue time, ITL, e2e, output tok/s, cache
hit ratio, per stage, and requests per replica. Same seed, same result: nothing reads a wall
clock. What it leaves out: the gateway's transport (Envoy, ext_proc, HTTP/2), the client, and
any CPU contention; latencies are the simulator's, in virtual seconds.

CLI: `python -m kvswitch.bench.fleet --help` (one workload, several routers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvswitch.bench.fleet.epp import EppRouter
from kvswitch.bench.fleet.multi_epp import MultiEppRouter
from kvswitch.bench.fleet.routers import (
    FleetContext,
    FleetRouter,
    LookaheadOracle,
    Oracle,
    RandomRouter,
    RoundRobin,
    SmgCacheAwareModel,
)
from kvswitch.bench.fleet.sim import FleetResult, run_fleet

__all__ = [
    "BASELINES",
    "ORACLE_VARIANTS",
    "EppRouter",
    "FleetContext",
    "FleetResult",
    "FleetRouter",
    "MultiEppRouter",
    "best_of",
    "make_router",
    "run_fleet",
]

BASELINES = ("round-robin", "random", "oracle", "smg-cache-aware-model")
ORACLE_VARIANTS = ("oracle", "oracle-conserve", "oracle-lookahead")
"""What `oracle-best` takes the best of, per run."""


def make_router(name: str, seed: int = 0, kv_delay: float = 0.002) -> FleetRouter:
    """A router by name (see the module docstring); a fresh one per run."""
    base, at, count = name.rpartition("@")
    if at and count.isdigit():
        epp = make_router(base, seed, kv_delay)
        if not isinstance(epp, EppRouter):
            raise ValueError(f"{name!r}: only an EPP config runs as several replicas")
        return MultiEppRouter(epp.config, int(count), name, kv_delay, seed)
    kind, _, argument = name.partition(":")
    if name == "round-robin":
        return RoundRobin()
    if name == "random":
        return RandomRouter(seed)
    if name == "oracle":
        return Oracle()
    if name == "oracle-conserve":
        return Oracle(conserve=0.5, name=name)
    if name == "oracle-lookahead":
        return LookaheadOracle()
    if name == "smg-cache-aware-model":
        return SmgCacheAwareModel("events", kv_delay=kv_delay)
    if name == "smg-cache-aware-tree-model":
        return SmgCacheAwareModel("tree")
    if name == "kvswitch":
        from kvswitch.launcher import DEFAULT_EPP_CONFIG

        return EppRouter(DEFAULT_EPP_CONFIG, name, kv_delay, seed)
    if kind == "epp" and argument:
        from kvswitch.bench.targets import config_path

        path = Path(argument)
        return EppRouter(path if path.is_file() else config_path(argument), name, kv_delay,
                         seed)
    raise ValueError(f"unknown fleet router {name!r}: round-robin, random, oracle, "
                     "oracle-conserve, oracle-lookahead, smg-cache-aware-model, "
                     "smg-cache-aware-tree-model, kvswitch, "
                     "epp:PATH or epp:NAME (a bundled config)")


def best_of(results: list[FleetResult], name: str = "oracle-best") -> FleetResult:
    """The best of several runs of one workload as one reference, relabelled `name`: per stage,
    the run with the lowest engine-side TTFT p90 at that stage (`steps[i]["from"]` names it);
    overall and the rest, the run with the lowest overall TTFT p90 (`overall["from"]`)."""
    def p90(summary: dict[str, Any]) -> float:
        value = summary.get("ttft_p90")
        return float("inf") if value is None else float(value)

    best = min(results, key=lambda r: p90(r.overall))
    steps = []
    for i in range(len(best.steps)):
        run = min(results, key=lambda r: p90(r.steps[i]))
        steps.append({**run.steps[i], "from": run.router})
    overall = {**best.overall, "from": best.router}
    return FleetResult(name, steps, overall, best.requests_per_replica, best.records,
                       best.replica_of, best.rejected, best.unfinished, best.sim_seconds,
                       sum(r.wall_seconds for r in results))
