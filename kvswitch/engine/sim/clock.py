"""The simulated clock and its pacing against real time.

Simulated time advances by each step's modelled duration while the engine is busy, and follows
the wall clock x `time_scale` while it is idle. The real time a step should end at is

    real_target = anchor_real + (sim - anchor_sim) / time_scale

The engine sleeps until then. `now()` is the simulated time the scheduler has reached (the end of
the step being paced); `at_real_time()` maps the current real time into simulated time (clamped
to `now()`), so an event during a paced step lands inside that step, as it would on a GPU. Sleeps
shorter than `min_sleep` (the event loop's timer granularity, ~1 ms) are skipped and the debt
carried, so pacing stays right on average; when Python falls more than `max_lag` behind, the anchor
moves (the "GPU" was slow) instead of bursting steps to catch up.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["SimClock"]


class SimClock:
    def __init__(
        self,
        time_scale: float = 1.0,
        *,
        real: Callable[[], float] = time.monotonic,
        min_sleep: float = 0.001,
        max_lag: float = 0.05,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self._real = real
        self.min_sleep = min_sleep
        self.max_lag = max_lag
        self._anchor_real = real()
        self._anchor_sim = 0.0
        self._sim = 0.0
        self._busy = False

    def now(self) -> float:
        """Simulated seconds since the clock started."""
        if self._busy:
            return self._sim
        return self._anchor_sim + (self._real() - self._anchor_real) * self.time_scale

    def at_real_time(self) -> float:
        """The simulated instant of the current real time: wall-following while idle; while busy
        between the current step's pacing anchor and `now()`, never beyond it (Python running
        late does not move simulated time). Monotonic."""
        mapped = self._anchor_sim + (self._real() - self._anchor_real) * self.time_scale
        return min(mapped, self._sim) if self._busy else mapped

    def resume(self) -> None:
        """Leave idle: the simulated time is wherever the wall clock has taken it."""
        if not self._busy:
            self._sim = max(self._sim, self.now())
            self._anchor_real, self._anchor_sim = self._real(), self._sim
            self._busy = True

    def pause(self) -> None:
        """Go idle: from now on simulated time follows the wall clock again."""
        if self._busy:
            self._busy = False
            real = self._real()
            # Never let idle time run backwards from the busy time already reached.
            if self._anchor_sim + (real - self._anchor_real) * self.time_scale < self._sim:
                self._anchor_real, self._anchor_sim = real, self._sim

    def advance(self, seconds: float) -> float:
        """Add one step's simulated duration; return the real seconds to sleep (0: just yield)."""
        if not self._busy:
            self.resume()
        self._sim += seconds
        delay = self._anchor_real + (self._sim - self._anchor_sim) / self.time_scale - self._real()
        if delay < -self.max_lag:
            self._anchor_real, self._anchor_sim = self._real(), self._sim
            return 0.0
        return delay if delay >= self.min_sleep else 0.0
