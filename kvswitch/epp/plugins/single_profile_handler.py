"""single-profile-handler: run the one scheduling profile once; its result is the answer.

Config check (in `kvswitch.epp.config`): exactly one schedulingProfile. Parameters: none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.contracts import InferenceRequest
from kvswitch.epp.framework import (
    CycleState,
    PluginHandle,
    ProfileResult,
    SchedulerProfile,
)

TYPE = "single-profile-handler"


class SingleProfileHandler:
    max_profiles = 1
    """Config check, and the scheduler's cue to run the profile without the calls below."""

    def __init__(self, name: str) -> None:
        self.name = name

    def pick_profiles(self, request: InferenceRequest, state: CycleState,
                      profiles: Mapping[str, SchedulerProfile],
                      results: Mapping[str, ProfileResult]) -> Sequence[SchedulerProfile]:
        return () if results else tuple(profiles.values())[:1]

    def process_results(self, request: InferenceRequest, state: CycleState,
                        results: Mapping[str, ProfileResult]) -> ProfileResult:
        return next(iter(results.values()))


def create(name: str, parameters: Mapping[str, Any],
           handle: PluginHandle) -> SingleProfileHandler:
    return SingleProfileHandler(name)
