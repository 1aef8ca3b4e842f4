"""prefix-cache-scorer: prefer endpoints that already hold the prompt's leading blocks.

Formula: score(e) = matched_blocks(e) / total_blocks (0 when the prompt has no full block).
Inputs: the `PrefixMatch` the shared `RoutedPrefixIndex` produced for this request (block hashes are
computed once per request however many profiles use this scorer); see
`kvswitch.epp.plugins.prefix_index` for hashing, the text approximation and LRU sizing.
Parameters (upstream names):
  blockSize (int, default 16 = vLLM's default; `hashBlockSize` accepted as an alias) - tokens
      per block; set it to the engine's block size so matches align with the engine's cache.
  maxPrefixBlocksToMatch (int, default 256), lruCapacityPerServer (int, default 31250, used
  when the engine does not report its KV capacity), charsPerToken (int, default 4, text only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.contracts import InferenceRequest
from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import ConfigError, CycleState, PluginHandle, param
from kvswitch.epp.plugins.prefix_index import SHARED_KEY, STATE_KEY, PrefixMatch, RoutedPrefixIndex

TYPE = "prefix-cache-scorer"


class PrefixCacheScorer:
    def __init__(self, name: str, index: RoutedPrefixIndex) -> None:
        self.name = name
        self.index = index

    def score(self, request: InferenceRequest, state: CycleState,
              endpoints: Sequence[Endpoint]) -> list[float]:
        match: PrefixMatch | None = state.get(STATE_KEY)
        if match is None or not match.hashes or not match.matched:
            return [0.0] * len(endpoints)
        total = len(match.hashes)
        matched = match.matched
        return [matched.get(e.address, 0) / total for e in endpoints]


def create(name: str, parameters: Mapping[str, Any], handle: PluginHandle) -> PrefixCacheScorer:
    block_size = param(parameters, "blockSize",
                       int, param(parameters, "hashBlockSize", int, 16))
    settings = {
        "block_size": block_size,
        "max_blocks": param(parameters, "maxPrefixBlocksToMatch", int, 256),
        "lru_capacity": param(parameters, "lruCapacityPerServer", int, 31250),
        "chars_per_token": param(parameters, "charsPerToken", int, 4),
    }
    for key, value in settings.items():
        if value < 1:
            raise ConfigError(f"parameters: {key} must be >= 1, got {value}")
    index = handle.shared(SHARED_KEY, lambda: RoutedPrefixIndex(**settings))
    if (index.block_size, index.max_blocks) != (block_size, settings["max_blocks"]):
        raise ConfigError("parameters.blockSize: every prefix-cache-scorer must share one "
                          "block size and maxPrefixBlocksToMatch")
    handle.datalayer.on_removed(index.forget)
    return PrefixCacheScorer(name, index)
