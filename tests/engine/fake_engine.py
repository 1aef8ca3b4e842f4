"""An in-memory `Engine` for servicer tests: deterministic tokens, a step clock you control,
a `max_num_seqs` admission window and KV batches, without the simulator's scheduler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from kvswitch.engine.base import (
    EngineCounters,
    EngineLoadSnapshot,
    GenerationRequest,
    GenerationUpdate,
    KvBlockStored,
    KvEventBatchData,
    ModelCard,
    SequenceDelta,
    TokenLogprob,
)
from kvswitch.errors import InvalidRequest

CARD = ModelCard(served_model_name="fake", model_path="fake/model", tokenizer_path="bundled",
                 max_model_len=256, vocab_size=151936, eos_token_ids=(151645,), block_size=4,
                 num_gpu_blocks=64, max_num_seqs=2)


class FakeEngine:
    def __init__(self, step_seconds: float = 0.0, fail_after: int | None = None):
        self.model = CARD
        self.step_seconds = step_seconds
        self.fail_after = fail_after
        self.running: set[str] = set()
        self.waiting: set[str] = set()
        self.aborted: set[str] = set()
        self.closed: list[str] = []
        self.flushed = False
        self._slots = asyncio.Semaphore(CARD.max_num_seqs)
        self._kv: list[KvEventBatchData] = []
        self._kv_added = asyncio.Event()
        self._generated = 0
        self._counts: dict[tuple[str, int], int] = {}

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.aborted |= self.running | self.waiting

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        rid, s = request.request_id, request.sampling
        if request.prompt_token_ids and request.prompt_token_ids[0] == 0:
            raise InvalidRequest("token 0 is refused by the fake", param="input")
        self.waiting.add(rid)
        try:
            async with self._slots:
                self.waiting.discard(rid)
                self.running.add(rid)
                self._store_blocks(request.prompt_token_ids)
                limit = s.max_tokens or 8
                done: dict[int, int] = {}
                first = True
                while len(done) < s.n:
                    await asyncio.sleep(self.step_seconds)
                    seqs = []
                    for index in range(s.n):
                        if index in done:
                            continue
                        produced = self._produced(rid, index)
                        token = 1000 + (s.seed or 0) + index * 100 + produced
                        lp = ([TokenLogprob(token, -0.5, tuple((token + k, -0.5 - k)
                                                               for k in range(5)))]
                              if s.logprobs is not None else None)
                        delta = SequenceDelta(index, [token], lp)
                        self._counts[(rid, index)] = produced + 1
                        self._generated += 1
                        if self.fail_after is not None and self._generated > self.fail_after:
                            raise RuntimeError("injected engine failure")
                        if rid in self.aborted:
                            delta.token_ids, delta.logprobs, delta.finish_reason = [], None, "abort"
                        elif token in s.stop_token_ids:
                            delta.finish_reason, delta.matched_stop = "stop", token
                        elif produced + 1 >= limit:
                            delta.finish_reason = "length"
                        if delta.finish_reason:
                            done[index] = 1
                        seqs.append(delta)
                    prompt_lp = None
                    if first and s.prompt_logprobs is not None:
                        prompt_lp = [None] + [TokenLogprob(t, -1.0, ((t, -1.0),))
                                              for t in request.prompt_token_ids[1:]]
                    cached = 4 if len(request.prompt_token_ids) >= 8 else 0
                    yield GenerationUpdate(rid, len(request.prompt_token_ids), cached, seqs,
                                           len(done) == s.n, prompt_lp)
                    first = False
        finally:
            self.waiting.discard(rid)
            self.running.discard(rid)
            self.closed.append(rid)

    def _produced(self, rid: str, index: int) -> int:
        return self._counts.get((rid, index), 0)

    def _store_blocks(self, ids: Sequence[int]) -> None:
        parent = None
        stored = []
        for start in range(0, len(ids) - len(ids) % 4, 4):
            block_hash = hash(tuple(ids[: start + 4])) & ((1 << 64) - 1)
            stored.append(KvBlockStored(block_hash, parent, tuple(ids[start:start + 4])))
            parent = block_hash
        self._kv.append(KvEventBatchData(len(self._kv) + 1, 0.0, tuple(stored)))
        self._kv_added.set()

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.aborted.update(r for r in request_ids if r in self.running or r in self.waiting)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.running or request_id in self.waiting

    async def embed(self, request_id: str, token_ids: Sequence[int]) -> list[float]:
        return [float(t % 7) for t in token_ids[:3]] + [0.0] * 5

    def is_healthy(self) -> bool:
        return True

    def load(self) -> EngineLoadSnapshot:
        return EngineLoadSnapshot(len(self.running), len(self.waiting), 0, len(self.running),
                                  CARD.num_gpu_blocks, CARD.block_size, CARD.max_num_seqs,
                                  0.0, 0.0)

    def counters(self) -> EngineCounters:
        return EngineCounters(0, self._generated, 0, 0, 0, {"length": 1})

    async def kv_events(self, start_sequence_number: int = 0) -> AsyncIterator[KvEventBatchData]:
        position = max(start_sequence_number - 1, 0)
        while True:
            while position < len(self._kv):
                yield self._kv[position]
                position += 1
            self._kv_added.clear()
            await self._kv_added.wait()

    async def flush_cache(self) -> bool:
        self.flushed = not self.running
        return self.flushed
