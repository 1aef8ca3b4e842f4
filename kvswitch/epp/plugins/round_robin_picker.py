"""round-robin-picker: cycle through endpoints in address order, ignoring scores (a baseline).

Rule: the k-th request goes to endpoints sorted by address at position k mod n; fallbacks are
the next ones in the cycle. Parameters: maxNumOfEndpoints (int >= 1, default 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.contracts import InferenceRequest
from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import CycleState, PluginHandle, max_endpoints_param

TYPE = "round-robin-picker"


class RoundRobinPicker:
    def __init__(self, name: str, max_endpoints: int = 1) -> None:
        self.name = name
        self.max_endpoints = max_endpoints
        self._next = 0

    def pick(self, request: InferenceRequest, state: CycleState,
             endpoints: Sequence[Endpoint], scores: Sequence[float]) -> tuple[Endpoint, ...]:
        if not endpoints:
            return ()
        ordered = sorted(endpoints, key=lambda e: e.address)
        n = len(ordered)
        start = self._next % n
        self._next += 1
        return tuple(ordered[(start + k) % n] for k in range(min(self.max_endpoints, n)))


def create(name: str, parameters: Mapping[str, Any], handle: PluginHandle) -> RoundRobinPicker:
    n = max_endpoints_param(parameters)
    return RoundRobinPicker(name, n)
