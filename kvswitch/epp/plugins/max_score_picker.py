"""max-score-picker: the endpoint with the highest total score (the default picker).

Rule: order endpoints by total score, highest first, ties broken at random; return the first
`maxNumOfEndpoints` (the pick, then fallbacks in score order).
Parameters: maxNumOfEndpoints (int >= 1, default 1, as upstream).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import CycleState, PluginHandle, max_endpoints_param
from kvswitch.epp.request import InferenceRequest

TYPE = "max-score-picker"


class MaxScorePicker:
    def __init__(self, name: str, max_endpoints: int = 1, rng: random.Random | None = None) -> None:
        self.name = name
        self.max_endpoints = max_endpoints
        self._rng = rng or random.Random()

    def pick(self, request: InferenceRequest, state: CycleState,
             endpoints: Sequence[Endpoint], scores: Sequence[float]) -> tuple[Endpoint, ...]:
        if not endpoints:
            return ()
        if self.max_endpoints == 1:
            best = max(scores)
            ties = [i for i, s in enumerate(scores) if s == best]
            return (endpoints[ties[0] if len(ties) == 1 else self._rng.choice(ties)],)
        n = self.max_endpoints
        # Sorting the floats themselves and finding each winner by value costs ~1 us less
        # than sorting positions by key. With the top n + 1 distinct, each of the top n
        # occurs once, so `index` finds the one endpoint holding it.
        top = sorted(scores, reverse=True)[: n + 1]
        if len(set(top)) == len(top):
            index = scores.index
            return tuple([endpoints[index(s)] for s in top[:n]])
        # A tie among the chosen or at the cut (rare once loads differ): order equal scores by
        # a random key instead of by position.
        rnd = self._rng.random
        order = sorted(range(len(endpoints)), key=lambda i: (scores[i], rnd()), reverse=True)
        return tuple([endpoints[i] for i in order[:n]])


def create(name: str, parameters: Mapping[str, Any], handle: PluginHandle) -> MaxScorePicker:
    n = max_endpoints_param(parameters)
    return MaxScorePicker(name, n)
