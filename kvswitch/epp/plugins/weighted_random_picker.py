"""weighted-random-picker: random choice with probability proportional to total score.

Rule (weighted sampling without replacement, Efraimidis-Spirakis A-Res, as upstream):
    key(e) = u(e) ** (1 / score(e)),  u ~ U(0, 1);  order by key, highest first.
Endpoints scoring 0 come after every positive one, in random order; all zero -> uniform.
Parameters: maxNumOfEndpoints (int >= 1, default 1).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.contracts import InferenceRequest
from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import CycleState, PluginHandle, max_endpoints_param

TYPE = "weighted-random-picker"


class WeightedRandomPicker:
    def __init__(self, name: str, max_endpoints: int = 1, rng: random.Random | None = None) -> None:
        self.name = name
        self.max_endpoints = max_endpoints
        self.rng = rng or random.Random()  # public: a simulation seeds it so a run repeats

    def pick(self, request: InferenceRequest, state: CycleState,
             endpoints: Sequence[Endpoint], scores: Sequence[float]) -> tuple[Endpoint, ...]:
        rnd = self.rng.random
        keys = []
        for i, s in enumerate(scores):
            # Zero scores get keys in (-1, 0]: after every positive key, random among themselves.
            key = (1.0 - rnd()) ** (1.0 / s) if s > 0 else -rnd()
            keys.append((key, i))
        keys.sort(reverse=True)
        return tuple(endpoints[i] for _, i in keys[: self.max_endpoints])


def create(name: str, parameters: Mapping[str, Any],
           handle: PluginHandle) -> WeightedRandomPicker:
    n = max_endpoints_param(parameters)
    return WeightedRandomPicker(name, n)
