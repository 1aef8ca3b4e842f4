"""queue-scorer: prefer endpoints with short waiting queues.

Formula (min-max over the candidates, as upstream):
    score(e) = (max_q - q(e)) / (max_q - min_q),   q(e) = waiting(e) + unreported(e)
    every score is 1.0 when all queues are equal.
Inputs: `Metrics.waiting` (GetLoads num_waiting_reqs / vllm:num_requests_waiting) and
`Endpoint.unreported_requests` (routed here since the last report that covers them), so a
burst routed between two reports queues up in the score as it does on the engine.
Parameters: none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.contracts import InferenceRequest
from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import CycleState, PluginHandle

TYPE = "queue-scorer"


def min_max_inverse(values: Sequence[float]) -> list[float]:
    """1 for the smallest value, 0 for the largest, linear between; all 1 when equal."""
    low, high = min(values), max(values)
    if high == low:
        return [1.0] * len(values)
    span = high - low
    return [(high - v) / span for v in values]


class QueueScorer:
    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, request: InferenceRequest, state: CycleState,
              endpoints: Sequence[Endpoint]) -> list[float]:
        return min_max_inverse([e.metrics.waiting + e.unreported_requests for e in endpoints])


def create(name: str, parameters: Mapping[str, Any], handle: PluginHandle) -> QueueScorer:
    return QueueScorer(name)
