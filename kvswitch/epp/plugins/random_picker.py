"""random-picker: uniform random choice, ignoring scores (a baseline).

Parameters: maxNumOfEndpoints (int >= 1, default 1): the pick then random fallbacks.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.contracts import InferenceRequest
from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import CycleState, PluginHandle, max_endpoints_param

TYPE = "random-picker"


class RandomPicker:
    def __init__(self, name: str, max_endpoints: int = 1, rng: random.Random | None = None) -> None:
        self.name = name
        self.max_endpoints = max_endpoints
        self.rng = rng or random.Random()  # public: a simulation seeds it so a run repeats

    def pick(self, request: InferenceRequest, state: CycleState,
             endpoints: Sequence[Endpoint], scores: Sequence[float]) -> tuple[Endpoint, ...]:
        if not endpoints:
            return ()
        return tuple(self.rng.sample(list(endpoints), min(self.max_endpoints, len(endpoints))))


def create(name: str, parameters: Mapping[str, Any], handle: PluginHandle) -> RandomPicker:
    n = max_endpoints_param(parameters)
    return RandomPicker(name, n)
