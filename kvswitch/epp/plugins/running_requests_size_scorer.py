"""running-requests-size-scorer: prefer endpoints running fewer requests.

Formula (min-max, as queue-scorer):
    r(e) = max(running(e), in_flight(e))
    score(e) = (max_r - r(e)) / (max_r - min_r); all 1.0 when equal.
Inputs: `Metrics.running` (engine report, up to one refresh interval old) and the EPP's own
in-flight count (exact and instant, so a burst between two refreshes still spreads).
Parameters: none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.contracts import InferenceRequest
from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import CycleState, PluginHandle
from kvswitch.epp.plugins.queue_scorer import min_max_inverse

TYPE = "running-requests-size-scorer"


class RunningRequestsSizeScorer:
    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, request: InferenceRequest, state: CycleState,
              endpoints: Sequence[Endpoint]) -> list[float]:
        return min_max_inverse([max(e.metrics.running, e.in_flight) for e in endpoints])


def create(name: str, parameters: Mapping[str, Any],
           handle: PluginHandle) -> RunningRequestsSizeScorer:
    return RunningRequestsSizeScorer(name)
