"""RoutedPrefixIndex: which endpoint probably holds which prompt blocks (approximate prefix
caching).

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
- match: for each endpoint, the number of leading prompt blocks it holds (consecutive from 0),
  by binary search over its prefix-closed LRU (blocks are recorded tail first).
State written: `state[STATE_KEY] = PrefixMatch`; `uncached_tokens` reads it for the prefill a
request costs an endpoint.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvswitch.epp.contracts import InferenceRequest
from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import CycleState, ProfileResult

STATE_KEY = "prefix-index"
SHARED_KEY = "prefix-index"


# Not frozen: built per request, and a frozen __init__ calls object.__setattr__ per field.
@dataclass(slots=True)
class PrefixMatch:
    """The prefix facts of one request."""

    hashes: Sequence[int]
    """Chained hashes of the prompt's full blocks (capped at max_blocks); read-only."""
    matched: dict[str, int]
    """endpoint address -> leading blocks it holds; absent means 0."""
    block_tokens: int = 16
    """Prompt tokens per block (the index's block size)."""
    pending_prefill: Mapping[str, int] | None = None
    """endpoint address -> uncached prompt tokens routed there whose prefill has not ended
    (the precise index's, from KV events; absent: 0); None when the producer cannot tell."""
    prompt_tokens: int = -1
    """The prompt's length in tokens as the producer counted it (-1: not counted)."""
    prefilling: Mapping[str, int] | None = None
    """endpoint address -> requests counted in `pending_prefill` there (absent: 0)."""


def prompt_tokens(request: InferenceRequest, match: PrefixMatch | None) -> int:
    """The prompt's length in tokens: as the match counted it; else its token ids; else its
    full blocks; else ~4 characters per token of its text."""
    if match is not None and match.prompt_tokens >= 0:
        return match.prompt_tokens
    body = request.body
    if body.prompt_token_ids is not None:
        return len(body.prompt_token_ids)
    if match is not None and match.hashes:
        return len(match.hashes) * match.block_tokens
    if body.prompt_text:
        return len(body.prompt_text) // 4
    return 0


def uncached_tokens(request: InferenceRequest, match: PrefixMatch | None, address: str) -> int:
    """The prompt tokens `address` would have to prefill: those past its matched blocks."""
    if match is None or not match.matched:
        return prompt_tokens(request, match)
    return max(0, prompt_tokens(request, match) - match.matched.get(address, 0)
               * match.block_tokens)


def request_block_hashes(request: InferenceRequest, block_size: int, chars_per_token: int,
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


class RoutedPrefixIndex:
    name = "prefix-index"

    def __init__(self, block_size: int = 16, max_blocks: int = 256, lru_capacity: int = 31250,
                 chars_per_token: int = 4) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.lru_capacity = lru_capacity
        self.chars_per_token = chars_per_token
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def produce(self, request: InferenceRequest, state: CycleState,
                endpoints: Sequence[Endpoint]) -> None:
        hashes = request_block_hashes(request, self.block_size, self.chars_per_token,
                                      self.max_blocks)
        state[STATE_KEY] = PrefixMatch(hashes, self.match(hashes), self.block_size)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """endpoint -> leading blocks held. Each endpoint's LRU is prefix-closed (see `record`),
        so the count is found by binary search: O(log n) lookups per endpoint."""
        matched: dict[str, int] = {}
        if not hashes:
            return matched
        first = hashes[0]
        for address, lru in self._lru.items():
            if first not in lru:
                continue
            low, high = 1, len(hashes)  # hashes[:low] held; find the largest such low
            while low < high:
                mid = (low + high + 1) // 2
                if hashes[mid - 1] in lru:
                    low = mid
                else:
                    high = mid - 1
            matched[address] = low
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
        """Blocks `hashes` are now cached at `address` (most recently used).

        Touched last block first, so a block is always at least as recent as its descendants:
        eviction takes prompt tails first (as vLLM's free-block queue does) and every
        endpoint's set stays prefix-closed, which `match` relies on."""
        lru = self._lru.get(address)
        if lru is None:
            lru = self._lru[address] = OrderedDict()
        move = lru.move_to_end
        for h in reversed(hashes):
            if h in lru:
                move(h)
            else:
                lru[h] = None
        excess = len(lru) - capacity
        for _ in range(excess):
            lru.popitem(last=False)

    def forget(self, address: str) -> None:
        """The endpoint left the pool."""
        self._lru.pop(address, None)

    def size(self, address: str) -> int:
        return len(self._lru.get(address, ()))
