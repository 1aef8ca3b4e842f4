"""Start a set of child processes, wait until each is ready, watch them, stop them by PID.

`kvswitch up` and `kvswitch bench` both bring up engines, an EPP, frontends and Envoy this way:

    with Supervisor(log_dir) as sup:
        sup.start_all([ChildSpec("engine-0", argv, ready=port_open(8001)), ...])
        while True:
            for event in sup.poll():       # children that exited on their own
                ...
            time.sleep(0.5)
    # leaving the block stops every child: SIGTERM in reverse start order, then SIGKILL

Children run in their own session (a Ctrl-C in the terminal reaches only the supervisor, which
then stops them in order) and write stdout+stderr to `<log_dir>/<name>.log`. A child with
`restart=True` is started again (same argv) after it exits, up to `max_restarts` times, with
backoff: the n-th restart in a row waits `restart_backoff x 2^(n-1)` seconds (at most
`max_backoff`); a child that ran `stable_after` seconds before exiting starts the count afresh.
Each exit and each restart is logged ("exited with ...; restarting in 0.5 s", "restarted as").
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Self

__all__ = ["Child", "ChildExited", "ChildSpec", "Supervisor", "http_ok", "port_open"]

logger = logging.getLogger("kvswitch.supervisor")

ReadyProbe = Callable[[], bool]


def port_open(port: int, host: str = "127.0.0.1") -> ReadyProbe:
    """Ready when `host:port` accepts a TCP connection."""

    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False

    return probe


def http_ok(url: str) -> ReadyProbe:
    """Ready when GET `url` answers 200."""

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return int(response.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    return probe


@dataclass(frozen=True)
class ChildSpec:
    name: str
    """Unique, used for the log file name and in messages."""
    argv: Sequence[str]
    ready: ReadyProbe | None = None
    """Polled after start until true; None: ready as soon as started."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Added to the supervisor's environment."""
    stop_timeout: float = 10.0
    """Seconds between SIGTERM and SIGKILL (an engine's grace period plus a margin)."""
    restart: bool = False
    max_restarts: int = 5
    restart_backoff: float = 0.5
    """Seconds before the first restart in a row; doubled for each further one."""
    max_backoff: float = 10.0
    stable_after: float = 30.0
    """A child that ran this long before exiting is restarted as if for the first time."""


@dataclass(frozen=True, slots=True)
class ChildExited:
    """A child that exited without being asked to."""

    name: str
    pid: int
    returncode: int
    restarted_pid: int | None
    """The PID of its replacement, when restarted."""


class Child:
    """One running child process."""

    def __init__(self, spec: ChildSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.restarts = 0
        """Restarts in a row (since the child last ran `stable_after` seconds)."""
        self.restart_at: float | None = None
        """When a child waiting out its backoff is started again."""
        self.started_at = time.monotonic()
        self.reported = False
        """Its exit has been reported by `Supervisor.poll` (and it was not restarted)."""
        self._terminated_pid: int | None = None
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            list(self.spec.argv), stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **self.spec.env}, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def name(self) -> str:
        return self.spec.name

    def alive(self) -> bool:
        return self.proc.poll() is None

    def respawn(self) -> None:
        self.restart_at = None
        self.started_at = time.monotonic()
        self.proc = self._spawn()

    def schedule_restart(self, now: float) -> float:
        """Count a restart and set when it happens; returns the backoff in seconds."""
        spec = self.spec
        if now - self.started_at >= spec.stable_after:
            self.restarts = 0
        self.restarts += 1
        backoff = min(spec.restart_backoff * 2 ** (self.restarts - 1), spec.max_backoff)
        self.restart_at = now + backoff
        return backoff

    def wait_ready(self, deadline: float) -> None:
        probe = self.spec.ready
        while probe is not None and not probe():
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was "
                                   f"ready; last output:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready in time; last output:\n{self.tail()}")
            time.sleep(0.05)

    def terminate(self) -> None:
        """SIGTERM once: a second SIGTERM would cut a graceful shutdown short (the child's
        handler is gone once it starts draining), turning exit 0 into -15."""
        if self.alive() and self._terminated_pid != self.proc.pid:
            self._terminated_pid = self.proc.pid
            os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM, wait up to `timeout` (default the spec's), then SIGKILL. Idempotent."""
        self.terminate()
        try:
            self.proc.wait(timeout=self.spec.stop_timeout if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %d) ignored SIGTERM; killing it", self.name, self.pid)
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def tail(self, n_bytes: int = 3000) -> str:
        self._log.flush()
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode(errors="replace")


class Supervisor:
    """Owns children: starts them, reports unexpected exits, stops them all by PID."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self._stopping = False

    def start(self, spec: ChildSpec, timeout: float = 60.0) -> Child:
        """Start one child and wait until it is ready."""
        child = self.spawn(spec)
        child.wait_ready(time.monotonic() + timeout)
        return child

    def spawn(self, spec: ChildSpec) -> Child:
        """Start one child without waiting."""
        if any(c.name == spec.name for c in self.children):
            raise ValueError(f"duplicate child name {spec.name!r}")
        child = Child(spec, self.log_dir / f"{spec.name}.log")
        self.children.append(child)
        logger.info("started %s (pid %d)", spec.name, child.pid)
        return child

    def start_all(self, specs: Iterable[ChildSpec], timeout: float = 60.0) -> list[Child]:
        """Start the children together (they boot in parallel), then wait for each."""
        started = [self.spawn(spec) for spec in specs]
        deadline = time.monotonic() + timeout
        for child in started:
            child.wait_ready(deadline)
        return started

    def get(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def pids(self) -> list[int]:
        return [c.pid for c in self.children]

    def poll(self) -> list[ChildExited]:
        """Children that exited since the last poll and could not be restarted, and those
        started again once their backoff passed (`restarted_pid`)."""
        events: list[ChildExited] = []
        if self._stopping:
            return events
        now = time.monotonic()
        for child in self.children:
            if child.alive() or child.reported:
                continue
            pid, code = child.pid, child.proc.returncode
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.respawn()
                    logger.warning("%s (pid %d) exited with %d; restarted as pid %d",
                                   child.name, pid, code, child.pid)
                    events.append(ChildExited(child.name, pid, code, child.pid))
            elif child.spec.restart and (now - child.started_at >= child.spec.stable_after
                                         or child.restarts < child.spec.max_restarts):
                backoff = child.schedule_restart(now)
                logger.warning("%s (pid %d) exited with %d; restarting in %.1f s (restart %d "
                               "in a row, at most %d)", child.name, pid, code, backoff,
                               child.restarts, child.spec.max_restarts)
            else:
                logger.error("%s (pid %d) exited with %d", child.name, pid, code)
                child.reported = True
                events.append(ChildExited(child.name, pid, code, None))
        return events

    def stop_all(self) -> None:
        """SIGTERM every child (newest first, so Envoy stops taking traffic before the engines
        behind it), then wait for each; SIGKILL what outlives its stop timeout."""
        self._stopping = True
        for child in reversed(self.children):
            child.terminate()
        for child in reversed(self.children):
            code = child.stop()
            logger.info("stopped %s (pid %d, exit %s)", child.name, child.pid, code)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop_all()
