"""low-queue-filter: drop endpoints whose waiting queue is above a threshold.

Rule: keep e if waiting(e) <= threshold; when that would leave nothing, keep all (the
scorers then pick the least bad; flow control handles real saturation).
Inputs: `Metrics.waiting`. Parameters: threshold (int, default 128, as upstream).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.contracts import InferenceRequest
from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import CycleState, PluginHandle, param

TYPE = "low-queue-filter"


class LowQueueFilter:
    def __init__(self, name: str, threshold: int) -> None:
        self.name = name
        self.threshold = threshold

    def filter(self, request: InferenceRequest, state: CycleState,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        kept = [e for e in endpoints if e.metrics.waiting <= self.threshold]
        return kept or endpoints


def create(name: str, parameters: Mapping[str, Any], handle: PluginHandle) -> LowQueueFilter:
    return LowQueueFilter(name, param(parameters, "threshold", int, 128))
