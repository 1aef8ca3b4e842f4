"""`kvswitch up --tls-self-signed`: the gateway comes up on TLS, the Python lines it prints call
it as printed, and the certificates it made are gone once it stops; `--tls-dir` checks its
files before starting anything."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.processes import REPO, free_port
from tests.support.up import kvswitch_up


def test_up_with_self_signed_certificates(tmp_path: Path) -> None:
    port = free_port()
    args = ["--port", str(port), "--replicas", "1", "--profile", "tiny", "--time-scale", "100",
            "--mode", "echo", "--grace-period", "1", "--no-frontend", "--tls-self-signed",
            "--tls-handshake-timeout", "3"]
    with kvswitch_up(args, tmp_path, ready="Ctrl-C stops everything") as up:
        text = up.output()
        found = re.search(r"TLS on every hop, CA (\S+);", text)
        assert found is not None, text
        ca = Path(found.group(1))
        assert ca.is_file()
        # The printed Python program, run as printed, streams an answer over TLS.
        program = re.search(r"<<'EOF'\n(.*?)\nEOF", text, re.DOTALL)
        assert program is not None, text
        assert f"localhost:{port}" in program.group(1) and str(ca) in program.group(1)
        run = subprocess.run([sys.executable, "-"], input=program.group(1), text=True, check=False,
                             capture_output=True, timeout=60, cwd=REPO)
        assert run.returncode == 0, run.stderr
        assert "complete {" in run.stdout, run.stdout
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=60) == 0, up.output()
        assert not ca.parent.exists()  # the self-signed files went with it


def test_up_refuses_an_incomplete_tls_dir(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_text("")
    run = subprocess.run([sys.executable, "-m", "kvswitch", "up", "--port", str(free_port()),
                          "--tls-dir", str(tmp_path), "--log-dir", str(tmp_path / "state")],
                         capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert run.returncode == 2
    assert "missing server.crt, server.key, client.crt, client.key" in run.stderr + run.stdout
