"""CPU accounting during a target's run, so a report can show the run was not CPU-starved.

Every `interval` wall seconds it samples the 1-minute load average, the machine's busy cores
(`/proc/stat`) and the CPU time (user + system, all threads) of every process the bench started
(the supervisor's children: engines, Envoy, EPP, SMG) and of the bench client itself. The
summary gives, over the run: cores used per role (CPU seconds / wall seconds), the busiest single
process (mean and peak over the sampling intervals; a Python process cannot use more than ~1
core), the machine's busy cores and the load average (mean and max). Linux only (`/proc`);
elsewhere the summary says so.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of `pid` (every thread), seconds; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def machine_busy_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds summed over cores since boot, from /proc/stat."""
    try:
        line = Path("/proc/stat").read_text().splitlines()[0]
    except OSError:
        return None
    values = [int(v) for v in line.split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])
    return (total - idle) / _TICK, total / _TICK


def role(name: str) -> str:
    for prefix in ("engine", "envoy", "epp", "smg", "client"):
        if name.startswith(prefix):
            return prefix
    return "other"


class CpuMonitor:
    """`processes()` returns the (name, pid) pairs to watch; the client is added as `client`."""

    def __init__(self, processes: Callable[[], Iterable[tuple[str, int]]],
                 interval: float = 1.0) -> None:
        self.processes = processes
        self.interval = interval
        self._task: asyncio.Task[None] | None = None
        self._start: dict[tuple[str, int], float] = {}
        self._last: dict[tuple[str, int], float] = {}
        self._peak: dict[tuple[str, int], float] = {}
        self._loads: list[float] = []
        self._busy: list[float] = []
        self._machine0: tuple[float, float] | None = None
        self._t0 = 0.0
        self._t_last = 0.0
        self._wall = 0.0

    def _watched(self) -> list[tuple[str, int]]:
        return [*self.processes(), ("client", os.getpid())]

    def _sample(self) -> None:
        now = time.perf_counter()
        dt = now - self._t_last
        for key in self._watched():
            cpu = process_cpu_seconds(key[1])
            if cpu is None:
                continue
            if key not in self._start:
                self._start[key] = self._last[key] = cpu
            elif dt > 0:
                self._peak[key] = max(self._peak.get(key, 0.0), (cpu - self._last[key]) / dt)
            self._last[key] = cpu
        self._t_last = now
        self._loads.append(os.getloadavg()[0])

    async def _loop(self) -> None:
        machine = self._machine0
        while True:
            await asyncio.sleep(self.interval)
            self._sample()
            current = machine_busy_seconds()
            if machine is not None and current is not None and current[1] > machine[1]:
                self._busy.append((current[0] - machine[0]) / (current[1] - machine[1]))
            machine = current

    def start(self) -> None:
        self._t0 = self._t_last = time.perf_counter()
        self._machine0 = machine_busy_seconds()
        self._sample()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sample()
        self._wall = time.perf_counter() - self._t0
        return self.summary()

    def summary(self) -> dict[str, Any]:
        wall = self._wall or (time.perf_counter() - self._t0)
        if not self._start or wall <= 0:
            return {"available": False}
        used = {k: self._last[k] - self._start[k] for k in self._start}
        by_role: dict[str, float] = {}
        for (name, _), seconds in used.items():
            by_role[role(name)] = by_role.get(role(name), 0.0) + seconds / wall
        busiest = max(used, key=lambda k: used[k])
        machine = machine_busy_seconds()
        cores = os.cpu_count() or 1
        busy_mean = None
        if self._machine0 is not None and machine is not None and machine[1] > self._machine0[1]:
            busy_mean = cores * (machine[0] - self._machine0[0]) / (machine[1] - self._machine0[1])
        return {
            "available": True,
            "wall_seconds": wall,
            "cores": cores,
            "load_avg_1m_mean": sum(self._loads) / len(self._loads),
            "load_avg_1m_max": max(self._loads),
            "machine_busy_cores_mean": busy_mean,
            "machine_busy_cores_max": cores * max(self._busy) if self._busy else busy_mean,
            "bench_cores_by_role": {r: round(v, 3) for r, v in sorted(by_role.items())},
            "bench_cores_total": sum(used.values()) / wall,
            "busiest_process": busiest[0],
            "busiest_process_cores_mean": used[busiest] / wall,
            "busiest_process_cores_peak": max(self._peak.values(), default=0.0),
            "per_process_cores_mean": {k[0]: round(v / wall, 3) for k, v in sorted(used.items())},
        }
