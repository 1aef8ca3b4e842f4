"""Sequence tracking for one endpoint's KV-event stream (sans-IO).

The subscriber opens a stream with `tracker.resume_from()` as `start_sequence_number`, tells the
tracker (`stream_opened`), and hands it every batch (`receive`), which answers what to do:

- `LOAD_ONLY`: a load record (heartbeat); its sequence number only repeats the last one sent.
- `DUPLICATE`: already applied (a resumed stream replayed it); skip.
- `APPLY`: the next batch in order; apply its events to the index.
- `RESET`: the engine no longer holds the history we asked for (a resumed stream starts past
  the batch we need), or a relay sent a state snapshot: clear the endpoint's index, then apply.
  The index is `partial` afterwards when blocks stored in the missed batches may still be live.
  A resumed stream whose first batch comes before the cursor we asked for means the engine
  restarted (its numbering began again): also `RESET`.
- `GAP`: a live stream skipped a sequence number; close it and resubscribe from
  `resume_from()` (the engine may still hold the missed batches; if not, that stream's first
  batch yields `RESET`).

A fresh tracker (or one after `forget`) asks for sequence 0 and accepts whatever comes first:
kvswitch's simulator then replays its retained history (numbered from 0), so an index built late
still learns what the engine stored before; an engine that reads 0 as "from now on" gives live
batches only, and the index is `partial` (first batch numbered past 1).
"""

from __future__ import annotations

import enum

from kvswitch.epp.kvindex.events import EventBatch


class Verdict(enum.Enum):
    LOAD_ONLY = "load_only"
    DUPLICATE = "duplicate"
    APPLY = "apply"
    RESET = "reset"
    GAP = "gap"


class SequenceTracker:
    """Where one endpoint's stream is, and whether the index for it is complete."""

    def __init__(self) -> None:
        self.last: int | None = None
        """Sequence number of the last batch applied; None before any."""
        self.partial = False
        """True when the index may lack blocks the engine holds (history was lost)."""
        self.gaps = 0
        self.resets = 0
        self._requested: int | None = None

    def resume_from(self) -> int:
        return 0 if self.last is None else self.last + 1

    def stream_opened(self, start_sequence_number: int) -> None:
        self._requested = start_sequence_number

    def forget(self) -> None:
        """Start over (the engine restarted): the caller clears the endpoint's index."""
        self.last = None
        self.partial = False
        self._requested = None

    def receive(self, batch: EventBatch) -> Verdict:
        if batch.load_only:
            return Verdict.LOAD_ONLY
        seq = batch.sequence_number
        first_on_stream, requested = self._requested is not None, self._requested
        self._requested = None
        if batch.snapshot is not None:
            return self._snapshot(batch)
        last = self.last
        if first_on_stream and last is not None and requested and seq < requested:
            # A stream never replays before the cursor we asked for: a new engine life.
            self.last = seq
            self.partial = seq > 1
            self.resets += 1
            return Verdict.RESET
        if last is not None and seq <= last:
            return Verdict.DUPLICATE
        if last is None:
            # Fresh: take the first batch whatever its number (engines number from 0 or 1); a
            # later start means batches before it were lost to us.
            self.last = seq
            self.partial = self.partial or seq > max(requested or 0, 1)
            return Verdict.APPLY
        if seq == last + 1:
            self.last = seq
            return Verdict.APPLY
        # seq > last + 1
        if first_on_stream:
            # We asked for `expected` and the engine starts later: that history is gone.
            self.last = seq
            self.partial = True
            self.resets += 1
            return Verdict.RESET
        self.gaps += 1
        return Verdict.GAP

    def _snapshot(self, batch: EventBatch) -> Verdict:
        snapshot = batch.snapshot
        assert snapshot is not None
        self.last = batch.sequence_number
        if snapshot.index == 0:
            # Chunk 0 starts with AllBlocksCleared; the chunks rebuild the whole state.
            self.partial = snapshot.unknown_before > 0
            self.resets += 1
            return Verdict.RESET
        return Verdict.APPLY
