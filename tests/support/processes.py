"""Start real kvswitch/Envoy processes for tests, wait for their ports, and end them by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

# The ports and command lines kvswitch's own launcher uses.
from kvswitch.launcher import free_port, kvswitch_argv

__all__ = ["REPO", "Process", "free_port", "kvswitch_argv", "running", "wait_for_port"]

REPO = Path(__file__).resolve().parents[2]


def wait_for_port(port: int, timeout: float = 30.0,
                  proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open within {timeout}s")


class Process:
    """A child process with its output captured to a file, ended by PID."""

    def __init__(self, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()
        return self.proc.returncode


@contextmanager
def running(argv: Sequence[str], port: int, log_path: Path, timeout: float = 30.0,
            env: dict[str, str] | None = None) -> Iterator[Process]:
    """Run `argv` until the block ends; wait until `port` accepts connections first."""
    process = Process(argv, log_path, env)
    try:
        wait_for_port(port, timeout, process.proc)
        yield process
    except BaseException:
        print(process.output()[-4000:], file=sys.stderr)
        raise
    finally:
        process.stop()
