"""Continuous batching as vLLM V1's scheduler does it (sans-IO: no asyncio, no clock).

One `step()`:
1. Running sequences, in order, each get their remaining tokens (1 when decoding, a chunk when
   prefilling) capped by the step's token budget `max_num_batched_tokens`. When the KV cache
   cannot hold a sequence's new tokens, the LAST running sequence is preempted (recompute
   policy: its blocks are freed, it goes back to the FRONT of the waiting queue), repeatedly,
   possibly the sequence itself.
2. If nothing was preempted, waiting sequences are admitted in FCFS order while the budget,
   `max_num_seqs` and free blocks allow: each first takes its longest cached prefix (full
   blocks, leaving at least one token to compute), then a chunk of the rest (chunked prefill).
3. The step "runs": computed counts advance, and every sequence that has computed all its
   tokens samples one token and is checked for stop conditions. Finished sequences free their
   blocks at once.

The step's simulated duration is the profile's step model (see `profiles`) over the uncached
prefill and decode tokens it scheduled and their contexts: the decoding sequences' KV tokens, and
per prefill chunk the KV tokens it ends with and the query-key pairs it attends. The sums are kept
while scheduling, O(1) per scheduled sequence, so work per step is O(scheduled sequences).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvswitch.engine.sim.kv_cache import KvCacheManager
from kvswitch.engine.sim.profiles import SimProfile
from kvswitch.engine.sim.request import SeqStatus, SimSequence
from kvswitch.engine.sim.sampler import StopChecker, TokenSource, simulated_logprob

__all__ = ["Scheduler", "SchedulerLimits", "StepResult"]


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(slots=True)
class StepResult:
    """What one step ran and produced."""

    duration: float
    """Simulated seconds (profile step model)."""
    prefill_tokens: int
    decode_tokens: int
    decode_context: int = 0
    """The decoding sequences' KV tokens, summed."""
    prefill_context: int = 0
    """The prefill chunks' KV tokens after the step (cached + chunk), summed."""
    prefill_pairs: int = 0
    """The prefill chunks' attended query-key pairs, summed."""
    outputs: list[SimSequence] = field(default_factory=list)
    """Sequences that produced a token (their last in `token_ids`); some may have finished."""
    scheduled: int = 0
    preempted: int = 0
    first_scheduled: list[SimSequence] = field(default_factory=list)
    """Sequences this step ran for the first time (their queue time ends at the step's start)."""


class Scheduler:
    """Waiting queue, running batch and the KV cache of one simulated engine."""

    def __init__(
        self,
        profile: SimProfile,
        limits: SchedulerLimits,
        kv: KvCacheManager,
        tokens: TokenSource,
        stopper: StopChecker,
        vocab_size: int,
    ) -> None:
        self.profile = profile
        self.limits = limits
        self.kv = kv
        self.tokens = tokens
        self.stopper = stopper
        self.vocab_size = vocab_size
        self.waiting: deque[SimSequence] = deque()
        self.running: list[SimSequence] = []
        self.waiting_uncached_tokens = 0
        # Counters since start.
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0

    # -- queue management ------------------------------------------------------------------
    def add(self, seq: SimSequence) -> None:
        """Queue a new sequence (its prompt's block hashes are computed here, once)."""
        self.kv.hash_full_blocks(seq)
        self._enqueue(seq, front=False)
        self.prompt_tokens += seq.num_prompt_tokens

    def _enqueue(self, seq: SimSequence, *, front: bool) -> None:
        seq.status = SeqStatus.WAITING if not front else SeqStatus.PREEMPTED
        (self.waiting.appendleft if front else self.waiting.append)(seq)
        # An estimate: what the cache would not serve if it were admitted now.
        seq.waiting_estimate = seq.num_tokens - self.kv.count_cached_tokens(seq)
        self.waiting_uncached_tokens += seq.waiting_estimate

    def _dequeue_estimate(self, seq: SimSequence) -> None:
        self.waiting_uncached_tokens -= seq.waiting_estimate
        seq.waiting_estimate = 0

    def abort(self, seq: SimSequence, reason: str = "abort") -> bool:
        """Remove a sequence wherever it is and free its blocks now; False if already done."""
        if seq.status is SeqStatus.FINISHED:
            return False
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
            self._dequeue_estimate(seq)
        self._finish(seq, reason)
        return True

    def _finish(self, seq: SimSequence, reason: str) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        self.kv.free(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> StepResult:
        budget = self.limits.max_num_batched_tokens
        scheduled: list[SimSequence] = []
        prefill = decode = preempted = 0
        decode_ctx = prefill_ctx = pairs = 0
        kv, bs = self.kv, self.kv.block_size
        running = self.running

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            n = len(seq.token_ids) - computed
            n = min(n, budget)
            total = computed + n
            # Fast path (a decode inside its last block, nothing to cache): no allocation call.
            if (
                total > len(seq.blocks) * bs
                or min(total, len(seq.token_ids)) // bs > seq.num_cached_blocks
            ):
                ok = True
                while not kv.allocate_slots(seq, n):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted += 1
                    if victim is seq:
                        ok = False
                        break
                if not ok:
                    break
            seq.num_scheduled = n
            scheduled.append(seq)
            budget -= n
            if n == 1 and computed >= seq.num_prompt_tokens:
                decode += 1
                decode_ctx += total
            else:
                prefill += n
                prefill_ctx += total
                pairs += n * computed + n * (n + 1) // 2
            i += 1

        first: list[SimSequence] = []
        if not preempted:
            admitted = self._admit(scheduled, budget, first)
            prefill += admitted[0]
            prefill_ctx += admitted[1]
            pairs += admitted[2]

        out = StepResult(
            duration=self.profile.step_seconds(
                prefill,
                decode,
                decode_context=decode_ctx,
                prefill_context=prefill_ctx,
                prefill_pairs=pairs,
            ),
            prefill_tokens=prefill,
            decode_tokens=decode,
            decode_context=decode_ctx,
            prefill_context=prefill_ctx,
            prefill_pairs=pairs,
            scheduled=len(scheduled),
            preempted=preempted,
            first_scheduled=first,
        )
        self._update(scheduled, out.outputs)
        return out

    def _admit(
        self, scheduled: list[SimSequence], budget: int, first: list[SimSequence]
    ) -> tuple[int, int, int]:
        """Admit waiting sequences FCFS (first admissions also go to `first`); returns the
        prefill tokens scheduled for them, their KV tokens and attended pairs (see `step`)."""
        kv, waiting, running = self.kv, self.waiting, self.running
        max_seqs = self.limits.max_num_seqs
        tokens = context = pairs = 0
        while waiting and budget > 0 and len(running) < max_seqs:
            seq = waiting[0]
            hits = kv.find_cached_prefix(seq)
            num_hit = len(hits) * kv.block_size
            n = min(seq.num_tokens - num_hit, budget)
            if not kv.allocate_slots(seq, n, hits):
                break
            self._dequeue_estimate(seq)
            waiting.popleft()
            seq.num_computed_tokens = num_hit
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_hit
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += num_hit
                first.append(seq)
            seq.status = SeqStatus.RUNNING
            running.append(seq)
            seq.num_scheduled = n
            scheduled.append(seq)
            budget -= n
            tokens += n
            context += num_hit + n
            pairs += n * num_hit + n * (n + 1) // 2
        return tokens, context, pairs

    def _preempt(self, seq: SimSequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.preemptions += 1
        self._enqueue(seq, front=True)

    def _update(self, scheduled: list[SimSequence], outputs: list[SimSequence]) -> None:
        """Apply the step's results: advance computed counts, sample, check stops."""
        next_token, check = self.tokens.next_token, self.stopper.check
        finished = False
        for seq in scheduled:
            seq.num_computed_tokens += seq.num_scheduled
            if seq.num_computed_tokens < len(seq.token_ids):
                continue  # a prefill chunk that has not reached the end: no sample
            token = next_token(seq)
            seq.token_ids.append(token)
            if seq.sampling.logprobs is not None:
                seq.last_logprob = simulated_logprob(
                    token, seq.num_output_tokens - 1, seq.sampling.logprobs, self.vocab_size
                )
            outputs.append(seq)
            if check(seq, token):
                finished = True
        self.generation_tokens += len(outputs)
        if finished:
            keep = []
            for seq in self.running:
                if seq.finish_reason is None:
                    keep.append(seq)
                else:
                    self._finish(seq, seq.finish_reason)
            self.running = keep
