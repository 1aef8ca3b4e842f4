"""The supervisor restarts a child that exits, with backoff doubling per restart in a row, says
so in its log, and gives up after `max_restarts`."""

from __future__ import annotations

import itertools
import logging
import sys
import time
from pathlib import Path

import pytest

from kvswitch.supervisor import ChildExited, ChildSpec, Supervisor


def test_restarts_back_off_and_give_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvswitch.supervisor")
    spec = ChildSpec("crasher", [sys.executable, "-c", "import sys; sys.exit(3)"], restart=True,
                     max_restarts=3, restart_backoff=0.2, stable_after=60.0)
    events: list[tuple[float, ChildExited]] = []
    with Supervisor(tmp_path) as supervisor:
        started = time.monotonic()
        supervisor.start(spec)
        deadline = started + 20
        while time.monotonic() < deadline:  # bounded polling, as `kvswitch up` polls
            events += [(time.monotonic(), e) for e in supervisor.poll()]
            if events and events[-1][1].restarted_pid is None:
                break
            time.sleep(0.01)
    restarts = [(at, e) for at, e in events if e.restarted_pid is not None]
    assert [e.returncode for _, e in events] == [3, 3, 3, 3]
    assert len(restarts) == 3 and events[-1][1].restarted_pid is None
    # 0.2 s, 0.4 s, 0.8 s before the restarts: at least 1.4 s in all, each gap longer.
    times = [started] + [at for at, _ in restarts]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4 and gaps[2] >= 0.8
    text = caplog.text
    assert "restarting in 0.2 s" in text and "restarting in 0.8 s" in text
    assert text.count("restarted as pid") == 3
    assert "crasher (pid" in text and "exited with 3" in text


def test_a_child_that_ran_a_while_counts_its_restarts_afresh(tmp_path: Path) -> None:
    spec = ChildSpec("steady", [sys.executable, "-c", "import sys; sys.exit(1)"], restart=True,
                     max_restarts=1, restart_backoff=0.1, stable_after=0.0)
    with Supervisor(tmp_path) as supervisor:
        child = supervisor.start(spec)
        deadline = time.monotonic() + 20
        restarted = 0
        while time.monotonic() < deadline and restarted < 3:  # bounded
            restarted += sum(e.restarted_pid is not None for e in supervisor.poll())
            time.sleep(0.01)
        # With stable_after 0 every exit counts as the first: never past max_restarts.
        assert restarted == 3 and child.restarts == 1
