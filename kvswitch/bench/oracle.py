"""The oracle: route each request, with perfect knowledge, to the engine that serves it first.

The bench client itself routes (no gateway in the path) and knows, per engine:
- its prefix cache *exactly*: a `KvBlockIndex` fed by the engine's own `SubscribeKvEvents`
  stream (what is cached now), plus the prompts the oracle has sent there that are not prefilled
  yet (what will be cached by the time this request is scheduled);
- its queue exactly: it is the only client of the engines during its run, so the prefill work
  it has sent there and not yet prefilled (uncached prompt tokens before the first token) and
  the requests decoding there are known without sampling. A request's prefill is over when its
  first token arrives (streamed) or, without streaming, when the engine's KV events store the
  prompt's last full block (the step that computes it also samples the first token); a prompt
  whose last block was already cached when it was sent has no such event, and is taken as
  prefilled at its estimated TTFT;
- the engine's cost model: the simulator profile's own step model (`SimProfile.step_seconds`),
  with chunked prefill at `max_num_batched_tokens` tokens per step.

Estimated TTFT of request r on engine e (simulated seconds), P = pending_prefill(e) +
uncached(r, e) (uncached = prompt - cached prefix), B = the step token budget, D = requests
decoding on e and C their context tokens:
    ttft(e) = floor(P / B) x step(B, D, C) + step(P mod B, D, C)
where step(p, d, c) is the profile's step time for p prefill tokens (one chunk attending to
itself) beside d decodes of c context tokens. The oracle picks argmin ttft(e) + conserve x
step(uncached(r, e)) (ties: fewest decoding, then lowest index): `conserve` 0 (the default) is the
pure greedy TTFT choice; above 0 it also charges the prefill a cache miss spends, which would
otherwise serve later requests (a variant of the stronger reference, `kvswitch.bench.fleet`).

This is the greedy optimum for each request under perfect information: no router that sees less
can place a request where it starts sooner by the model. It is not a global optimum over the
whole arrival sequence (a placement can hurt later requests), so treat it as a strong reference
ceiling rather than a proven bound; a router beating it on some step is possible and reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvswitch.bench.client import RequestResult
from kvswitch.bench.workloads import BenchRequest
from kvswitch.engine.sim.profiles import SimProfile
from kvswitch.epp.kvindex import BlocksRemoved, BlocksStored, KvBlockIndex, StoredBlock


@dataclass(slots=True)
class _EngineQueue:
    pending_prefill: int = 0
    """Uncached prompt tokens sent and not yet answered by a first token."""
    decoding: int = 0
    decode_context: int = 0
    """Prompt tokens of the requests decoding (their context, outputs aside)."""
    waiting: dict[int, int] = field(default_factory=dict)
    """request index -> its uncached tokens, until its first token."""


@dataclass(frozen=True, slots=True)
class _Prefill:
    """How to tell, without its first token, that a sent request has been prefilled."""

    engine: str
    last_block: int
    """Hash of the prompt's last full block: stored by the engine when prefill computes it."""
    done_by: float | None
    """Already cached when sent (no event to wait for): prefilled by this simulated time."""


class OracleRouter:
    """Sans-IO placement: `choose` before sending, `first_token` / `finished` as they happen."""

    def __init__(self, engines: Sequence[str], profile: SimProfile, index: KvBlockIndex,
                 clock: Callable[[], float] = time.monotonic, conserve: float = 0.0) -> None:
        self.engines = list(engines)
        self.conserve = conserve
        self.clock = clock
        """Simulated seconds (wall x time scale): when estimated TTFTs run out."""
        self._prefilling: dict[int, _Prefill] = {}
        self.profile = profile
        self.index = index
        """Exact cache contents, kept by the KV-event subscribers."""
        self.pending = KvBlockIndex(index.block_size)
        """Prompts sent and not yet prefilled (synthetic engine hashes: (request, block))."""
        self.queues = {e: _EngineQueue() for e in self.engines}
        self._placed: dict[int, tuple[str, int]] = {}
        self._prompt_len: dict[int, int] = {}

    def estimate(self, engine: str, uncached: int) -> float:
        queue = self.queues[engine]
        return self.prefill_seconds(queue.pending_prefill + uncached, queue.decoding,
                                    queue.decode_context)

    def prefill_seconds(self, work: int, decoding: int = 0, decode_context: int = 0) -> float:
        """Steps to prefill `work` tokens in budget-sized chunks beside `decoding` decodes."""
        p = self.profile
        budget = p.max_num_batched_tokens
        full, rest = divmod(work, budget)
        total = 0.0
        if full:
            total += full * p.step_seconds(budget, decoding, decode_context=decode_context,
                                           prefill_context=budget,
                                           prefill_pairs=budget * (budget + 1) // 2)
        if rest or not full:
            total += p.step_seconds(rest, decoding, decode_context=decode_context,
                                    prefill_context=rest, prefill_pairs=rest * (rest + 1) // 2)
        return total

    def choose(self, request: BenchRequest) -> str:
        self._settle_prefills()
        hashes = self.index.block_hashes(request.prompt_ids)
        cached = self.index.match(hashes, self.engines)
        soon = self.pending.match(hashes, self.engines)
        size = self.index.block_size
        n = len(request.prompt_ids)
        best: tuple[float, int, int] | None = None
        chosen = self.engines[0]
        for i, engine in enumerate(self.engines):
            # The engine recomputes at least the last prompt token (vLLM's rule).
            hit = min(max(cached[engine], soon[engine]) * size, n - 1)
            cost = self.estimate(engine, n - hit)
            if self.conserve:
                cost += self.conserve * self.prefill_seconds(n - hit)
            key = (cost, self.queues[engine].decoding, i)
            if best is None or key < best:
                best, chosen = key, engine
        uncached = n - min(max(cached[chosen], soon[chosen]) * size, n - 1)
        if hashes:
            held = cached[chosen] == len(hashes)
            done_by = self.clock() + self.estimate(chosen, uncached) if held else None
            self._prefilling[request.index] = _Prefill(chosen, hashes[-1], done_by)
        self._send(request, chosen, hashes, uncached)
        return chosen

    def _settle_prefills(self) -> None:
        """Requests whose prefill is over by the KV events (or their estimate) start decoding."""
        now = self.clock()
        for index, p in list(self._prefilling.items()):
            if (now >= p.done_by if p.done_by is not None
                    else self.index.match((p.last_block,), (p.engine,))[p.engine]):
                self._prefilled(index)

    def _send(self, request: BenchRequest, engine: str, hashes: list[int], uncached: int) -> None:
        queue = self.queues[engine]
        queue.pending_prefill += uncached
        queue.waiting[request.index] = uncached
        size = self.index.block_size
        tokens = request.prompt_ids
        blocks = tuple(StoredBlock.of(request.index << 20 | i, tokens[i * size:(i + 1) * size])
                       for i in range(len(hashes)))
        self.pending.apply(engine, [BlocksStored(blocks, None, size)])
        self._placed[request.index] = (engine, len(blocks))
        self._prompt_len[request.index] = len(tokens)

    def first_token(self, request: BenchRequest) -> None:
        self._prefilled(request.index)

    def _prefilled(self, index: int) -> None:
        self._prefilling.pop(index, None)
        placed = self._placed.get(index)
        if placed is None:
            return
        engine, _ = placed
        queue = self.queues[engine]
        uncached = queue.waiting.pop(index, None)
        if uncached is not None:
            queue.pending_prefill -= uncached
            queue.decoding += 1
            queue.decode_context += self._prompt_len.get(index, 0)
            self._forget_pending(index)

    def finished(self, request: BenchRequest, result: RequestResult | None) -> None:
        self._prefilling.pop(request.index, None)
        placed = self._placed.pop(request.index, None)
        prompt_len = self._prompt_len.pop(request.index, 0)
        if placed is None:
            return
        engine, _ = placed
        queue = self.queues[engine]
        uncached = queue.waiting.pop(request.index, None)
        if uncached is None:
            queue.decoding -= 1
            queue.decode_context -= prompt_len
        else:  # failed before its first token
            queue.pending_prefill -= uncached
        self._forget_pending(request.index, placed)

    def _forget_pending(self, index: int, placed: tuple[str, int] | None = None) -> None:
        engine, count = placed or self._placed[index]
        self.pending.apply(engine, [BlocksRemoved(tuple(index << 20 | i for i in range(count)))])
