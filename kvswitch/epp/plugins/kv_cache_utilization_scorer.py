"""kv-cache-utilization-scorer: prefer endpoints with free KV cache.

Formula: score(e) = 1 - kv_usage(e), kv_usage in [0, 1].
Inputs: `Metrics.kv_usage` (GetLoads num_used_tokens / max_total_num_tokens, or
vllm:kv_cache_usage_perc). Parameters: none. Upstream alias: `kv-cache-scorer`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import CycleState, PluginHandle
from kvswitch.epp.request import InferenceRequest

TYPE = "kv-cache-utilization-scorer"


class KvCacheUtilizationScorer:
    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, request: InferenceRequest, state: CycleState,
              endpoints: Sequence[Endpoint]) -> list[float]:
        return [1.0 - e.metrics.kv_usage for e in endpoints]


def create(name: str, parameters: Mapping[str, Any],
           handle: PluginHandle) -> KvCacheUtilizationScorer:
    return KvCacheUtilizationScorer(name)
