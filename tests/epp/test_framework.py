"""The scheduling framework: registry, profile runner (clamp + weights), scheduler cycle."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvswitch.epp import framework
from kvswitch.epp.config_fields import duration
from kvswitch.epp.contracts import InferenceRequest, ParsedBody
from kvswitch.epp.datalayer import Datalayer, Endpoint, EndpointSpec
from kvswitch.epp.framework import (
    ConfigError,
    CycleState,
    PluginHandle,
    ProfileResult,
    Scheduler,
    SchedulerProfile,
    load_factory,
)
from kvswitch.epp.plugins.max_score_picker import MaxScorePicker
from kvswitch.epp.plugins.single_profile_handler import SingleProfileHandler

REQ = InferenceRequest("r", "grpc", "/p", ParsedBody())


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(EndpointSpec(f"10.0.0.{i}:8000")) for i in range(n)]


class FixedScorer:
    def __init__(self, name: str, scores: Sequence[float]) -> None:
        self.name = name
        self.scores = scores

    def score(self, request: InferenceRequest, state: CycleState,
              eps: Sequence[Endpoint]) -> list[float]:
        return list(self.scores[: len(eps)])


class DropFirst:
    name = "drop-first"

    def filter(self, request: InferenceRequest, state: CycleState,
               eps: Sequence[Endpoint]) -> Sequence[Endpoint]:
        return eps[1:]


def test_every_registered_type_imports_with_its_type_and_factory() -> None:
    for type_name in framework.REGISTRY:
        assert callable(load_factory(type_name))


def test_unknown_type_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown plugin type 'nope'"):
        load_factory("nope")


def test_upstream_alias_resolves() -> None:
    assert load_factory("kv-cache-scorer") is load_factory("kv-cache-utilization-scorer")


def test_entry_point_plugins_are_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(framework, "_entry_points",
                        lambda: {"queue-scorer-ext": "kvswitch.epp.plugins.queue_scorer"})
    # The module's TYPE must match the name it is registered under.
    with pytest.raises(ConfigError, match="lacks TYPE/create"):
        load_factory("queue-scorer-ext")
    assert "queue-scorer-ext" in framework.known_types()


def test_profile_clamps_scores_and_applies_weights() -> None:
    eps = endpoints(3)
    # Totals after clamping: e0 = 2*1 + 3*0 = 2, e1 = 2*0.5 + 3*0 = 1, e2 = 2*0 + 3*1 = 3.
    a = FixedScorer("a", [5.0, 0.5, 0.0])  # clamps to 1, 0.5, 0
    b = FixedScorer("b", [-3.0, 0.0, 1.0])  # clamps to 0, 0, 1
    seen: list[list[float]] = []

    class Recorder(MaxScorePicker):
        def pick(self, request, state, eps_, scores):  # type: ignore[no-untyped-def]
            seen.append(list(scores))
            return super().pick(request, state, eps_, scores)

    profile = SchedulerProfile("p", [], [(a, 2.0), (b, 3.0)], Recorder("m"))
    result = profile.run(REQ, {}, eps)
    assert seen == [[2.0, 1.0, 3.0]]
    assert result.endpoints == (eps[2],)


def test_filters_run_before_scorers_and_empty_means_no_pick() -> None:
    eps = endpoints(2)
    profile = SchedulerProfile("p", [DropFirst()], [], MaxScorePicker("m"))
    assert profile.run(REQ, {}, eps).endpoints == (eps[1],)
    assert profile.run(REQ, {}, eps[:1]).endpoints == ()


def test_scheduler_runs_producers_then_profile_then_pre_request() -> None:
    calls: list[str] = []

    class Producer:
        name = "producer"

        def produce(self, request, state, eps):  # type: ignore[no-untyped-def]
            calls.append("produce")
            state["x"] = 1

    class Hook:
        name = "hook"

        def pre_request(self, request, state: CycleState, result: ProfileResult) -> None:
            calls.append(f"pre_request {state['x']} {result.endpoints[0].address}")

    eps = endpoints(2)
    profile = SchedulerProfile("default", [], [(FixedScorer("s", [0.0, 1.0]), 1.0)],
                               MaxScorePicker("m"))
    scheduler = Scheduler(SingleProfileHandler("h"), {"default": profile}, [Producer(), Hook()])
    result = scheduler.schedule(REQ, eps)
    assert result.profile == "default"
    assert calls == ["produce", "pre_request 1 10.0.0.1:8000"]


class TwoProfiles:
    """A handler that runs "first", then "second" if the first picked nothing."""

    name = "two"

    def pick_profiles(self, request, state, profiles, results):  # type: ignore[no-untyped-def]
        if not results:
            return [profiles["first"]]
        if "second" not in results and not results["first"].endpoints:
            return [profiles["second"]]
        return []

    def process_results(self, request, state, results):  # type: ignore[no-untyped-def]
        return results.get("second") or results["first"]


def test_scheduler_consults_a_multi_profile_handler_until_it_is_done() -> None:
    eps = endpoints(2)
    first = SchedulerProfile("first", [DropFirst(), DropFirst()], [], MaxScorePicker("m"))
    second = SchedulerProfile("second", [], [(FixedScorer("s", [1.0, 0.0]), 1.0)],
                              MaxScorePicker("m"))
    scheduler = Scheduler(TwoProfiles(), {"first": first, "second": second}, [])
    result = scheduler.schedule(REQ, eps)
    assert (result.profile, result.endpoints) == ("second", (eps[0],))


def test_a_one_profile_handler_answers_with_its_profile_without_per_request_calls() -> None:
    class OneProfile(SingleProfileHandler):
        def pick_profiles(self, *args):  # type: ignore[no-untyped-def]
            raise AssertionError("not consulted per request")

    eps = endpoints(3)
    profile = SchedulerProfile("only", [], [(FixedScorer("s", [0.2, 0.9, 0.1]), 1.0)],
                               MaxScorePicker("m"))
    result = Scheduler(OneProfile("h"), {"only": profile}, []).schedule(REQ, eps)
    assert (result.profile, result.endpoints) == ("only", (eps[1],))


def test_scores_outside_zero_one_are_clamped() -> None:
    eps = endpoints(4)
    seen: list[list[float]] = []

    class Recorder(MaxScorePicker):
        def pick(self, request, state, eps_, scores):  # type: ignore[no-untyped-def]
            seen.append(list(scores))
            return super().pick(request, state, eps_, scores)

    scorer = FixedScorer("a", [1.0, 0.0, -0.0, 1.5])
    SchedulerProfile("p", [], [(scorer, 2.0)], Recorder("m")).run(REQ, {}, eps)
    assert seen == [[2.0, 0.0, 0.0, 2.0]]


def test_plugin_handle_shares_objects_and_names_missing_plugins() -> None:
    handle = PluginHandle(Datalayer())
    first = handle.shared("k", dict)
    assert handle.shared("k", list) is first
    with pytest.raises(ConfigError, match="no plugin named 'x'"):
        handle.plugin("x")


@pytest.mark.parametrize(("text", "seconds"), [("50ms", 0.05), ("2s", 2.0), ("1m", 60.0),
                                               (0.5, 0.5), ("1.5s", 1.5)])
def test_durations(text: object, seconds: float) -> None:
    assert duration(text, "f") == pytest.approx(seconds)


def test_bad_duration_names_the_field() -> None:
    with pytest.raises(ConfigError, match="^flowControl.maxWait: expected a duration"):
        duration("soon", "flowControl.maxWait")
