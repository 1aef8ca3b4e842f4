"""Simulated time vs real time, with a fake wall clock."""

from __future__ import annotations

import pytest

from kvswitch.engine.sim.clock import SimClock


class FakeReal:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_busy_time_advances_by_step_durations_and_paces_real_time() -> None:
    real = FakeReal()
    clock = SimClock(10.0, real=real)
    clock.resume()
    assert clock.advance(0.5) == pytest.approx(0.05)  # 0.5 s simulated at 10x
    assert clock.now() == pytest.approx(0.5)


def test_short_sleeps_are_carried_until_worth_sleeping() -> None:
    real = FakeReal()
    clock = SimClock(1000.0, real=real, min_sleep=0.001)
    clock.resume()
    # 0.4 s simulated = 0.4 ms real each: below the timer granularity, so the debt is carried.
    delays = [clock.advance(0.4) for _ in range(3)]
    assert delays == [0.0, 0.0, pytest.approx(0.0012)]
    assert clock.now() == pytest.approx(1.2)


def test_falling_behind_moves_the_anchor_instead_of_bursting() -> None:
    real = FakeReal()
    clock = SimClock(1.0, real=real, max_lag=0.05)
    clock.resume()
    real.t += 1.0  # Python stalled for a second
    assert clock.advance(0.01) == 0.0
    assert clock.advance(0.01) == pytest.approx(0.01)  # pacing resumes from the new anchor


def test_idle_time_follows_the_wall_clock() -> None:
    real = FakeReal()
    clock = SimClock(100.0, real=real)
    clock.resume()
    clock.advance(1.0)
    real.t += 0.01  # the step's real time
    clock.pause()
    real.t += 0.5
    assert clock.now() == pytest.approx(1.0 + 50.0)
    clock.resume()
    assert clock.now() == pytest.approx(51.0)
