"""`kvswitch up` as a child process for tests: its output in a file, read (bounded polls) until a
line appears, and on the way out ended by PID together with every child it said it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.processes import REPO

__all__ = ["UpProcess", "alive", "kvswitch_up"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes only once reaped; `up` reaps its children.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1][:1] != "Z"


@dataclass
class UpProcess:
    proc: subprocess.Popen[bytes]
    log: Path
    children: list[int] = field(default_factory=list)
    """The PIDs `up` said it started (a test adds those it restarts)."""

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, pattern: str, seconds: float = 60.0) -> re.Match[str] | None:
        """The first match of `pattern` in the output, read every 0.1 s until it appears, `up`
        exits or `seconds` pass; None if it never appeared."""
        waited = threading.Event()
        for _ in range(int(seconds * 10)):  # bounded
            found = re.search(pattern, self.output())
            if found is not None or self.proc.poll() is not None:
                return found
            waited.wait(0.1)
        return re.search(pattern, self.output())


@contextmanager
def kvswitch_up(args: Sequence[str], directory: Path,
                ready: str = "is up on") -> Iterator[UpProcess]:
    """`kvswitch up ARGS` with `--log-dir DIRECTORY/state` and its output in DIRECTORY/up.log,
    handed over once `ready` (a pattern) is in its output, or it exited, or 60 s passed, with
    `children` read from it. On the way out, `up` and any child still alive are killed."""
    log = directory / "up.log"
    argv = [sys.executable, "-m", "kvswitch", "up", *args, "--log-dir", str(directory / "state")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
    up = UpProcess(proc, log)
    try:
        up.wait_for(ready)
        up.children = [int(pid) for pid in re.findall(r"started \S+ \(pid (\d+)\)", up.output())]
        yield up
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid in up.children:  # only those `up` could not stop itself
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
