"""Per-request output collection with vLLM's merge-when-behind delivery.

The scheduler pushes every new token into the request's `OutputStream`. If the consumer has
taken the previous update, the push starts a new one; otherwise it is appended to the pending
update (a merge), so the scheduler never waits for a slow gRPC stream and the consumer always
gets everything since its last read in one update.

Each update carries the simulated time of its newest token (`time`), on the first one the
simulated seconds from arrival to the first scheduled step (`queue_seconds`), and on the one
holding the first token that token's time (`first_token_time`).

With `final_only` (a non-streamed request) the consumer is woken only when the request ends or
fails: every token merges into one pending update, so a long generation costs the consumer one
wake-up instead of one per step.
"""

from __future__ import annotations

import asyncio

from kvswitch.engine.base import GenerationUpdate, SequenceDelta, TokenLogprob
from kvswitch.engine.sim.request import SimSequence

__all__ = ["OutputStream"]


class OutputStream:
    __slots__ = (
        "arrival",
        "cached_tokens",
        "delta0",
        "done",
        "error",
        "final_only",
        "first_token_sent",
        "index_done",
        "num_done",
        "pending",
        "prompt_logprobs",
        "queue_seconds",
        "request_id",
        "scheduled",
        "sequences",
        "single",
        "waiter",
    )

    def __init__(
        self,
        request_id: str,
        sequences: list[SimSequence],
        prompt_logprobs: list[TokenLogprob | None] | None = None,
        arrival: float = 0.0,
        final_only: bool = False,
    ) -> None:
        self.request_id = request_id
        self.final_only = final_only
        self.first_token_sent = False
        self.arrival = arrival
        """Simulated arrival time."""
        self.scheduled = False
        self.queue_seconds: float | None = None
        """Set when first scheduled; sent once, on the first update."""
        self.sequences = sequences
        self.pending: GenerationUpdate | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.done = False
        """Every sequence has finished (the last update may still be pending)."""
        self.index_done = [False] * len(sequences)
        self.num_done = 0
        self.prompt_logprobs = prompt_logprobs
        """Sent once, on the first update."""
        self.cached_tokens = -1
        self.single = len(sequences) == 1
        # n == 1 fast path: the pending update's only delta, created with it.
        self.delta0: SequenceDelta | None = None

    def _update(self) -> GenerationUpdate:
        u = self.pending
        if u is None:
            if self.cached_tokens < 0:
                # Known once the first sequence was admitted, which precedes any output.
                self.cached_tokens = max(0, self.sequences[0].num_cached_tokens)
            if self.single:
                self.delta0 = SequenceDelta(0, [])
                deltas = [self.delta0]
            else:
                deltas = []
            u = self.pending = GenerationUpdate(
                self.request_id,
                self.sequences[0].num_prompt_tokens,
                self.cached_tokens,
                deltas,
                False,
                self.prompt_logprobs,
                self.queue_seconds,
            )
            self.prompt_logprobs = self.queue_seconds = None
            if not self.final_only:
                self._wake()
        return u

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _delta(self, u: GenerationUpdate, index: int) -> SequenceDelta:
        if self.single:
            return self.delta0  # type: ignore[return-value]
        for d in u.sequences:
            if d.index == index:
                return d
        d = SequenceDelta(index, [])
        u.sequences.append(d)
        return d

    def mark_scheduled(self, now: float) -> None:
        """The scheduler ran one of the request's sequences for the first time at `now`."""
        if not self.scheduled:
            self.scheduled = True
            self.queue_seconds = max(0.0, now - self.arrival)

    def push(self, seq: SimSequence, now: float) -> None:
        """Add `seq`'s newest token, produced at simulated time `now` (and its finish, if it
        finished)."""
        index = seq.index
        if self.index_done[index]:
            return  # ended by an abort while the step that produced this token ran
        u = self.pending or self._update()
        u.time = now
        if not self.first_token_sent:
            self.first_token_sent = True
            u.first_token_time = now
        d = self.delta0 if self.single else self._delta(u, index)
        assert d is not None
        d.token_ids.append(seq.token_ids[-1])
        if seq.last_logprob is not None:
            if d.logprobs is None:
                d.logprobs = []
            d.logprobs.append(seq.last_logprob)
        if seq.finish_reason is not None:
            self._end(u, d, seq.finish_reason, seq.matched_stop)

    def push_finish(self, seq: SimSequence, reason: str, now: float) -> None:
        """End a sequence without a new token (abort) at simulated time `now`."""
        if self.index_done[seq.index]:
            return
        u = self._update()
        u.time = now
        self._end(u, self._delta(u, seq.index), reason, None)

    def _end(
        self, u: GenerationUpdate, d: SequenceDelta, reason: str, matched: int | str | None
    ) -> None:
        d.finish_reason, d.matched_stop = reason, matched
        self.index_done[d.index] = True
        self.num_done += 1
        if self.num_done == len(self.sequences):
            u.finished = True
            u.num_preemptions = sum(s.num_preemptions for s in self.sequences)
            self.done = True
            self._wake()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    async def get(self) -> GenerationUpdate:
        """The next (possibly merged) update; raises the engine's error if it failed."""
        while self.pending is None:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        u, self.pending = self.pending, None
        return u
