"""PrefixIndex: which endpoint probably holds which prompt blocks (approximate prefix caching).

Produced once per request (a `DataProducer`), consumed by prefix-cache-scorer:
- Block hashes chain like vLLM's: h_0 = hash((seed, block_0)), h_i = hash((h_{i-1}, block_i)),
  seed = hash(model name), full blocks only, at most `max_blocks`.
  Token prompts: blocks of `block_size` token ids (default 16, vLLM's default block size; set it
  to the engine's). Text prompts (no token ids): blocks of `block_size * chars_per_token`
  characters (default 16 x 4 = 64 characters, upstream's default hashBlockSize in characters,
  ~4 characters per token for English BPE tokenizers).
- Per endpoint, an LRU of the block hashes the EPP has sent there, sized from the engine's KV
  capacity (max tokens / block_size, from GetLoads or vllm:cache_config_info) or
  `lru_capacity` when unknown. `pre_request` records the picked endpoint; the oldest blocks fall
  out as an engine's LRU would evict them.
- match: for each endpoint, the number of leading prompt blocks it holds (consecutive from 0).
State written: `state[STATE_KEY] = PrefixMatch`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import CycleState, ProfileResult
from kvswitch.epp.request import InferenceRequest

STATE_KEY = "prefix-index"
SHARED_KEY = "prefix-index"


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The prefix facts of one request."""

    hashes: tuple[int, ...]
    """Chained hashes of the prompt's full blocks (capped at max_blocks)."""
    matched: dict[str, int]
    """endpoint address -> leading blocks it holds; absent means 0."""


def block_hashes(request: InferenceRequest, block_size: int, chars_per_token: int,
                 max_blocks: int) -> tuple[int, ...]:
    """The chained block hashes of a request's prompt (see the module docstring)."""
    body = request.body
    prompt: Sequence[int] | str | None = body.prompt_token_ids
    step = block_size
    if prompt is None:
        prompt = body.prompt_text
        step = block_size * chars_per_token
    if not prompt:
        return ()
    parent = hash(body.model or "")
    n = min(len(prompt) // step, max_blocks)
    out = []
    for start in range(0, n * step, step):
        parent = hash((parent, prompt[start:start + step]))
        out.append(parent)
    return tuple(out)


class PrefixIndex:
    name = "prefix-index"

    def __init__(self, block_size: int = 16, max_blocks: int = 256, lru_capacity: int = 31250,
                 chars_per_token: int = 4) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.lru_capacity = lru_capacity
        self.chars_per_token = chars_per_token
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._owners: dict[int, set[str]] = {}

    def produce(self, request: InferenceRequest, state: CycleState,
                endpoints: Sequence[Endpoint]) -> None:
        hashes = block_hashes(request, self.block_size, self.chars_per_token, self.max_blocks)
        state[STATE_KEY] = PrefixMatch(hashes, self.match(hashes))

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        matched: dict[str, int] = {}
        if not hashes:
            return matched
        alive = self._owners.get(hashes[0])
        if not alive:
            return matched
        alive = set(alive)
        for i, h in enumerate(hashes):
            owners = self._owners.get(h)
            still = alive & owners if owners else set()
            if len(still) != len(alive):
                for address in alive - still:
                    matched[address] = i
                if not still:
                    return matched
                alive = still
        for address in alive:
            matched[address] = len(hashes)
        return matched

    def pre_request(self, request: InferenceRequest, state: CycleState,
                    result: ProfileResult) -> None:
        match = state.get(STATE_KEY)
        if match is None or not match.hashes:
            return
        endpoint = result.endpoints[0]
        self.record(endpoint.address, match.hashes, self._capacity(endpoint))

    def _capacity(self, endpoint: Endpoint) -> int:
        m = endpoint.metrics
        return m.max_tokens // self.block_size if m.max_tokens else self.lru_capacity

    def record(self, address: str, hashes: Sequence[int], capacity: int) -> None:
        """Blocks `hashes` are now cached at `address` (most recently used)."""
        lru = self._lru.setdefault(address, OrderedDict())
        owners = self._owners
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                owners.setdefault(h, set()).add(address)
        while len(lru) > capacity:
            old, _ = lru.popitem(last=False)
            holders = owners.get(old)
            if holders is not None:
                holders.discard(address)
                if not holders:
                    del owners[old]

    def forget(self, address: str) -> None:
        """The endpoint left the pool."""
        for h in self._lru.pop(address, ()):
            holders = self._owners.get(h)
            if holders is not None:
                holders.discard(address)
                if not holders:
                    del self._owners[h]

    def size(self, address: str) -> int:
        return len(self._lru.get(address, ()))
