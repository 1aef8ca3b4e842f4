"""The fleet simulator: deterministic, conserving, and its routers behave as they claim."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest

from kvswitch.bench.fleet import EppRouter, MultiEppRouter, best_of, make_router, run_fleet
from kvswitch.bench.fleet.routers import RoundRobin
from kvswitch.bench.workloads import SharedPrefixShape, build_workload
from kvswitch.engine.sim.profiles import get_profile
from kvswitch.tokenization import load_tokenizer

PROFILE = get_profile("qwen3-32b-2xh100")


@pytest.fixture(scope="module")
def shared_prefix() -> Any:
    # 24 groups of 2,000-token system prompts: where a request lands decides its cache hit.
    shape = SharedPrefixShape(24, 4, 2000, 100, 40)
    return build_workload(shape, (12.0, 24.0), 8.0, load_tokenizer(None), seed=3)


def _summary(result: Any) -> Any:
    return ([r.to_json() for r in result.records], result.requests_per_replica, result.steps)


def test_same_seed_same_result(shared_prefix: Any) -> None:
    for name in ("kvswitch", "random", "epp:random", "smg-cache-aware-model"):
        first = run_fleet(shared_prefix, make_router(name, seed=1), PROFILE, 4, seed=1)
        again = run_fleet(shared_prefix, make_router(name, seed=1), PROFILE, 4, seed=1)
        assert _summary(first) == _summary(again), name


def test_every_request_finishes_or_is_reported(shared_prefix: Any) -> None:
    n = len(shared_prefix.requests)
    for name in ("kvswitch", "oracle", "oracle-lookahead", "round-robin"):
        result = run_fleet(shared_prefix, make_router(name), PROFILE, 4)
        assert len(result.records) + len(result.rejected) + len(result.unfinished) == n
        assert len(result.records) == n, name
        assert sum(result.requests_per_replica) == n
        assert all(r.completion_tokens == 40 and r.finish_reason == "length"
                   for r in result.records)


def test_a_drain_limit_reports_the_requests_still_running(shared_prefix: Any) -> None:
    result = run_fleet(shared_prefix, RoundRobin(), PROFILE, 1, drain_limit=0.0)
    n = len(shared_prefix.requests)
    assert result.unfinished and len(result.records) + len(result.unfinished) == n


def test_on_step_sees_every_step_that_produced_a_token(shared_prefix: Any) -> None:
    seen: dict[int, list[tuple[float, float, int]]] = {}

    def on_step(replica: Any, start: float, step: Any) -> None:
        seen.setdefault(replica.index, []).append((start, step.duration, len(step.outputs)))

    result = run_fleet(shared_prefix, RoundRobin(), PROFILE, 4, on_step=on_step)
    assert sorted(seen) == [0, 1, 2, 3]
    for index, steps in seen.items():
        # A replica runs one step at a time, and each token is produced by a step it ran.
        assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(steps))
        tokens = sum(r.completion_tokens for r in result.records
                     if result.replica_of[r.request_id] == index)
        assert sum(produced for _, _, produced in steps) == tokens > 0


def test_round_robin_spreads_evenly(shared_prefix: Any) -> None:
    result = run_fleet(shared_prefix, make_router("round-robin"), PROFILE, 4)
    counts = result.requests_per_replica
    assert max(counts) - min(counts) <= 1


def test_the_oracle_beats_random_on_a_shared_prefix_workload(shared_prefix: Any) -> None:
    oracle = run_fleet(shared_prefix, make_router("oracle"), PROFILE, 4)
    rand = run_fleet(shared_prefix, make_router("random", seed=0), PROFILE, 4)
    assert oracle.overall["cache_hit_rate"] > rand.overall["cache_hit_rate"] + 0.05
    assert oracle.overall["ttft_p90"] < rand.overall["ttft_p90"]


def test_oracle_best_takes_the_best_variant_per_step(shared_prefix: Any) -> None:
    runs = [run_fleet(shared_prefix, make_router(n), PROFILE, 4)
            for n in ("oracle", "oracle-conserve")]
    best = best_of(runs)
    assert best.router == "oracle-best"
    assert best.overall["ttft_p90"] == min(r.overall["ttft_p90"] for r in runs)
    assert best.overall["from"] in ("oracle", "oracle-conserve")
    for i, step in enumerate(best.steps):  # per step, the best variant at that step
        assert step["ttft_p90"] == min(r.steps[i]["ttft_p90"] for r in runs)
        assert step["from"] in ("oracle", "oracle-conserve")


class _Recorder(EppRouter):
    """The kvswitch profile, recording when each batch is published and delivered."""

    def __init__(self, delay: float) -> None:
        from kvswitch.launcher import DEFAULT_EPP_CONFIG

        super().__init__(DEFAULT_EPP_CONFIG, "recorder", kv_delay=delay)
        self.published: dict[tuple[int, int], float] = {}
        self.delivered: list[tuple[int, int, float, int, int]] = []

    def kv_batch(self, replica: int, batch: Any, now: float) -> None:
        self.published[(replica, batch.sequence_number)] = now
        super().kv_batch(replica, batch, now)

    def _deliver(self, replica: int, data: bytes) -> None:
        from kvswitch.epp.kvindex.events import batch_from_proto
        from kvswitch.protocol.packed import KvEventBatchView

        seq = batch_from_proto(KvEventBatchView.FromString(data)).sequence_number
        index = next(iter(self.subscribers[0].values())).index
        address = self.addresses[replica]
        before = index.num_blocks(address)
        super()._deliver(replica, data)
        self.delivered.append((replica, seq, self.ctx.now(), before,
                               index.num_blocks(address)))


def test_kv_events_reach_the_epp_only_after_their_delivery_delay(shared_prefix: Any) -> None:
    router = _Recorder(delay=0.2)
    result = run_fleet(shared_prefix, router, PROFILE, 4)
    assert len(result.records) == len(shared_prefix.requests)
    assert router.delivered
    grew = 0
    for replica, seq, at, before, after in router.delivered:
        assert at == pytest.approx(router.published[(replica, seq)] + 0.2)
        grew += after > before
    assert grew  # blocks entered the index, and only inside these deliveries


class _EndRecorder(EppRouter):
    """The kvswitch profile, recording when each request ended and when the router heard."""

    def __init__(self, log_flush: float) -> None:
        from kvswitch.launcher import DEFAULT_EPP_CONFIG

        super().__init__(DEFAULT_EPP_CONFIG, "ends", kv_delay=0.002, log_flush=log_flush)
        self.ended: dict[str, float] = {}
        self.heard: dict[str, tuple[float, float | None]] = {}

    def finished(self, request: Any, replica: int, now: float) -> None:
        self.ended[str(request.index)] = now
        super().finished(request, replica, now)

    def setup(self, ctx: Any) -> None:
        super().setup(ctx)
        finish = self.router.request_finished

        def heard(request: Any, outcome: Any) -> None:
            self.heard[request.request_id] = (self.ctx.now(), outcome.duration)
            finish(request, outcome)
        self.router.request_finished = heard  # type: ignore[method-assign]


def test_ends_reach_the_epp_with_the_gateways_access_log_flush(shared_prefix: Any) -> None:
    router = _EndRecorder(log_flush=0.05)
    run_fleet(shared_prefix, router, PROFILE, 4)
    assert router.heard.keys() == router.ended.keys()  # the last flush too
    late = 0
    for request_id, (at, duration) in router.heard.items():
        ended = router.ended[request_id]
        # Heard at the first flush tick after the end, plus the hop; dated by its duration.
        tick = at - 0.002
        assert ended < tick <= ended + 0.05 + 1e-9
        assert tick / 0.05 == pytest.approx(round(tick / 0.05))
        assert duration is not None and 0 < duration <= ended
        late += at - ended > 0.01
    assert late > len(router.heard) / 2
    instant = _EndRecorder(log_flush=0.0)
    run_fleet(shared_prefix, instant, PROFILE, 4)
    assert instant.heard.keys() == instant.ended.keys()
    assert all(at == instant.ended[r] for r, (at, _) in instant.heard.items())


def test_kv_batches_are_coalesced_per_window(shared_prefix: Any) -> None:
    router = _Recorder(delay=0.0)
    run_fleet(shared_prefix, router, PROFILE, 2, coalesce_seconds=0.05)
    for replica in range(2):
        times = sorted(t for (r, _), t in router.published.items() if r == replica)
        assert all(b - a >= 0.05 - 1e-9 for a, b in itertools.pairwise(times))


def test_the_defaults_new_prefix_groups_spread_evenly(shared_prefix: Any) -> None:
    import copy

    from kvswitch.launcher import DEFAULT_EPP_CONFIG

    def groups_per_replica(config: Any, seed: int) -> list[int]:
        result = run_fleet(shared_prefix, EppRouter(config, "g", seed=seed), PROFILE, 4,
                           seed=seed)
        first: dict[int, int] = {}
        for r in sorted(shared_prefix.requests, key=lambda r: r.send_at):
            first.setdefault(r.group, result.replica_of[str(r.index)])
        return sorted(Counter(first.values()).values())

    # 24 groups: each replica takes 6 groups' first requests, on every seed.
    assert all(groups_per_replica(DEFAULT_EPP_CONFIG, seed) == [6] * 4 for seed in range(3))
    # Placed by the load of the moment alone, they are not.
    by_load = copy.deepcopy(DEFAULT_EPP_CONFIG)
    for plugin in by_load["plugins"]:
        if plugin["type"] == "max-score-picker":
            plugin["parameters"].pop("newPrefixTolerance")
    assert any(groups_per_replica(by_load, seed) != [6] * 4 for seed in range(3))


class _PendingRecorder(EppRouter):
    """The kvswitch profile, recording the EPP's prefill in progress after each KV batch."""

    def __init__(self) -> None:
        from kvswitch.launcher import DEFAULT_EPP_CONFIG

        super().__init__(DEFAULT_EPP_CONFIG, "pending")
        self.pending: list[int] = []

    def _deliver(self, replica: int, data: bytes) -> None:
        super()._deliver(replica, data)
        index = next(iter(self.subscribers[0].values())).index
        self.pending.append(index.pending_prefill(self.addresses[replica]))


def test_a_long_prompts_prefill_in_progress_falls_with_each_chunk() -> None:
    import dataclasses

    shape = SharedPrefixShape(1, 1, 30_000, 16, 4)  # ~30k tokens: 4 chunks of 8,192
    workload = build_workload(shape, (4.0,), 1.0, load_tokenizer(None), seed=0)
    workload = dataclasses.replace(workload, requests=workload.requests[:1])
    router = _PendingRecorder()
    result = run_fleet(workload, router, PROFILE, 1)
    assert len(result.records) == 1
    full = len(workload.requests[0].prompt_ids) // 16 * 16
    # Between the chunks' batches the count falls by about a chunk each, to none at the end.
    during = [p for p in router.pending if 0 < p < full]
    assert len(during) >= 2 and during == sorted(during, reverse=True)
    assert router.pending[-1] == 0


def test_fleet_cli_runs_routers_and_writes_json(tmp_path: Any) -> None:
    import json

    from kvswitch.bench.fleet.__main__ import main

    out = tmp_path / "fleet.json"
    assert main(["--preset", "tiny", "--routers", "round-robin,kvswitch", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["router"] for r in results] == ["round-robin", "kvswitch"]
    assert all(sum(r["requests_per_replica"]) == 59 for r in results)


def test_the_panel_checks_issue_24s_targets_per_member_and_step() -> None:
    from tests.support.benchmarks import load_script

    panel_module = load_script("routing_panel")

    def steps(*p90: float) -> dict[str, Any]:
        return {"steps": [{"qps": float(i + 1), "ttft_p90": v} for i, v in enumerate(p90)]}

    panel = [{"member": "m", "routers": {
        "oracle-best": steps(1.0, 1.0), "round-robin": steps(1.5, 1.1),
        "smg-cache-aware-model": steps(1.3, 2.0), "mine": steps(1.19, 1.3)}}]
    result = panel_module.check_targets(panel, ["mine"], 0.0)["mine"]
    assert result["rows"] == 2 and not result["all_met"]
    assert result["misses"] == {"oracle-best x1.2": ["m@2"], "round-robin": ["m@2"],
                                "smg-cache-aware-model": []}


class _Ctx:
    """A bare FleetContext for routers tested on their own."""

    def __init__(self, n: int) -> None:
        from kvswitch.bench.fleet.replica import Replica

        self.profile = PROFILE
        self.replicas = [Replica(i, PROFILE) for i in range(n)]
        self.requests: list[Any] = []
        self.timers: list[tuple[float, Any]] = []

    def now(self) -> float:
        return 0.0

    def call_at(self, when: float, callback: Any) -> None:
        self.timers.append((when, callback))


def test_smg_model_follows_cached_prefixes_until_load_is_imbalanced(shared_prefix: Any) -> None:
    from kvswitch.bench.fleet.routers import SmgCacheAwareModel
    from kvswitch.engine.base import KvBlockStored, KvEventBatchData

    router = SmgCacheAwareModel("events", kv_delay=0.01)
    ctx = _Ctx(3)
    router.setup(ctx)  # type: ignore[arg-type]
    request = shared_prefix.requests[0]
    tokens, size = request.prompt_ids, PROFILE.block_size
    stored, parent = [], None
    for i in range(len(tokens) // size):
        block = KvBlockStored(10_000 + i, parent, tuple(tokens[i * size:(i + 1) * size]))
        stored.append(block)
        parent = block.block_hash
    router.kv_batch(2, KvEventBatchData(0, 0.0, tuple(stored)), 0.0)
    assert router.route(request, 0.0) == 0  # the batch is not delivered yet: least loaded
    for _, deliver in ctx.timers:
        deliver()
    assert router.route(request, 0.0) == 2  # replica 2 holds the prefix
    router.load = [40, 0, 5]  # max - min > 32 and max > 1.1 x min: shortest queue
    assert router.route(request, 0.0) == 1


def test_smg_model_keeps_more_prefix_hits_than_random(shared_prefix: Any) -> None:
    smg = run_fleet(shared_prefix, make_router("smg-cache-aware-model"), PROFILE, 4)
    tree = run_fleet(shared_prefix, make_router("smg-cache-aware-tree-model"), PROFILE, 4)
    rand = run_fleet(shared_prefix, make_router("random"), PROFILE, 4)
    assert smg.overall["cache_hit_rate"] > rand.overall["cache_hit_rate"]
    assert tree.overall["cache_hit_rate"] > rand.overall["cache_hit_rate"]


def test_flow_control_holds_requests_until_the_pool_has_room(shared_prefix: Any) -> None:
    from kvswitch.launcher import DEFAULT_EPP_CONFIG

    config = {**DEFAULT_EPP_CONFIG, "flowControl": {"maxWait": "60s"},
              "saturationDetector": {"queueDepthThreshold": 1, "kvCacheUtilThreshold": 0.05}}
    router = EppRouter(config, "queueing")
    held: list[int] = []
    step = router._step

    def spy(request: Any, coro: Any, later: Any) -> Any:
        out = step(request, coro, later)
        if out is None and later is None and router._held:
            held.append(request.index)
        return out

    router._step = spy  # type: ignore[method-assign]
    result = run_fleet(shared_prefix, router, PROFILE, 2)
    assert held  # flow control queued some requests ...
    assert len(result.records) + len(result.rejected) == len(shared_prefix.requests)
    assert not router._held  # ... and released every one


def test_several_epps_share_the_requests_and_each_ends_its_own(shared_prefix: Any) -> None:
    one = run_fleet(shared_prefix, make_router("kvswitch"), PROFILE, 4)
    router = make_router("kvswitch@2")
    assert isinstance(router, MultiEppRouter)
    two = run_fleet(shared_prefix, router, PROFILE, 4)
    assert len(two.records) == len(shared_prefix.requests)
    # Each replica routed every other request, and every end went back to the one that
    # routed it: nothing is left in flight on either.
    routed = [sum(epp.router.metrics.requests.values.values())
              for epp in router.epps]
    assert abs(routed[0] - routed[1]) <= 1, routed
    assert all(e.in_flight == 0 for epp in router.epps for e in epp.router.datalayer.all())
    # Both subscribe to every engine's KV events: prefix groups stay together about as well.
    assert two.overall["cache_hit_rate"] >= one.overall["cache_hit_rate"] - 0.02


def test_a_killed_epp_routes_nothing_more_and_the_survivors_lose_no_request(
        shared_prefix: Any) -> None:
    router = make_router("kvswitch@3")
    assert isinstance(router, MultiEppRouter)
    dead = router.epps[0]
    kill_at = 3.0
    routed_at: list[tuple[float, Any]] = []
    for epp in router.epps:
        route = epp.route

        def spy(request: Any, now: float, epp: Any = epp, route: Any = route) -> Any:
            routed_at.append((now, epp))
            return route(request, now)

        epp.route = spy  # type: ignore[method-assign]
    setup = router.setup

    def setup_and_kill(ctx: Any) -> None:
        setup(ctx)
        ctx.call_at(kill_at, lambda: router.kill(0))

    router.setup = setup_and_kill  # type: ignore[method-assign]
    result = run_fleet(shared_prefix, router, PROFILE, 4)
    assert len(result.records) == len(shared_prefix.requests)  # none lost
    assert any(epp is dead for t, epp in routed_at if t < kill_at)
    after = [epp for t, epp in routed_at if t >= kill_at]
    assert after and dead not in after
    assert {id(e) for e in after} == {id(e) for e in router.epps[1:]}  # both survivors route
    assert router.kv_subscribers == 2
    # The survivors' ends all came back to them; the ends of what the dead one had in flight
    # went nowhere.
    assert all(e.in_flight == 0 for epp in router.epps[1:] for e in epp.router.datalayer.all())
    assert sum(e.in_flight for e in dead.router.datalayer.all()) > 0
    router.kill(1)
    with pytest.raises(ValueError, match="last EPP"):
        router.kill(2)
    assert router.alive == [router.epps[2]]


def _push_times(shared_prefix: Any) -> dict[int, list[float]]:
    """Per replica, when the pushes two EPPs receive fire, at the default push delay."""
    router = make_router("kvswitch@2")
    assert isinstance(router, MultiEppRouter)
    fired: dict[int, list[float]] = {}
    push = router.load_push

    def spy(replica: int, load: Any, now: float, queued: tuple[Any, ...] = ()) -> None:
        fired.setdefault(replica, []).append(now)
        push(replica, load, now, queued)

    router.load_push = spy  # type: ignore[method-assign]
    run_fleet(shared_prefix, router, PROFILE, 4)
    return fired


def test_a_replicas_pushes_are_at_least_the_interval_apart(
        shared_prefix: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvswitch.engine.sim import events

    def gaps(fired: dict[int, list[float]]) -> list[float]:
        return [b - a for times in fired.values() for a, b in itertools.pairwise(times)]

    interval = events.PUSH_INTERVAL_SECONDS
    assert all(gap >= interval - 1e-9 for gap in gaps(_push_times(shared_prefix)))
    # Without the interval, arrivals a few ms apart on one replica push sooner than that.
    monkeypatch.setattr(events, "PUSH_INTERVAL_SECONDS", events.LOAD_PUSH_SECONDS)
    assert min(gaps(_push_times(shared_prefix))) < interval


def test_with_several_epps_each_arrival_pushes_its_replicas_load_to_all(
        shared_prefix: Any) -> None:
    from kvswitch.epp.kvindex.events import batch_from_proto
    from kvswitch.protocol.packed import KvEventBatchView

    router = make_router("kvswitch@2")
    assert isinstance(router, MultiEppRouter)
    pushes: list[tuple[int, float]] = []
    push, kv_batch = router.load_push, router.kv_batch
    delivered: dict[int, list[tuple[str, Any]]] = {}  # per replica, in order: kind, routing core

    announced: list[tuple[str, float]] = []

    def spy(replica: int, load: Any, now: float, queued: tuple[Any, ...] = ()) -> None:
        pushes.append((replica, now))
        announced.extend((q.request_id, now) for q in queued)
        kind = "push with prompts" if queued else "push"
        delivered.setdefault(replica, []).append((kind, load.routing_core))
        push(replica, load, now, queued)

    def batch_spy(replica: int, batch: Any, now: float) -> None:
        delivered.setdefault(replica, []).append(("batch", batch.load.routing_core))
        kv_batch(replica, batch, now)

    router.load_push = spy  # type: ignore[method-assign]
    router.kv_batch = batch_spy  # type: ignore[method-assign]
    loads: list[tuple[float, Any]] = []
    epp = router.epps[1]
    deliver = epp._deliver

    def seen(replica: int, data: bytes) -> None:
        batch = batch_from_proto(KvEventBatchView.FromString(data))
        if batch.load_only:
            loads.append((epp.ctx.now(), batch.load))
        deliver(replica, data)

    epp._deliver = seen  # type: ignore[method-assign]
    result = run_fleet(shared_prefix, router, PROFILE, 4, load_push_seconds=0.005)
    arrivals: dict[int, set[float]] = {}
    for record in result.records:
        arrivals.setdefault(result.replica_of[record.request_id], set()).add(record.arrival)
    assert 0 < len(pushes) <= len(result.records)
    for replica, at in pushes:  # each push follows an arrival by the delay ...
        assert any(abs(at - 0.005 - t) < 1e-9 for t in arrivals[replica])
    for replica in range(4):  # ... and at most one is pending per replica
        times = sorted(at for r, at in pushes if r == replica)
        assert all(b - a >= 0.005 - 1e-9 for a, b in itertools.pairwise(times))
    # A prompt is announced once, on its replica's next push, if its prefill has not ended.
    records = {record.request_id: record for record in result.records}
    assert announced and len({rid for rid, _ in announced}) == len(announced)
    for rid, at in announced:
        record = records[rid]
        assert record.ttft_s is not None and record.arrival < at <= record.arrival + record.ttft_s
    # Here every prefill (2,100 tokens) outlasts the push delay: every prompt is announced.
    assert len(announced) == len(records)
    # A push without prompts never repeats the load its replica last delivered.
    for records in delivered.values():
        assert all(b[1] != a[1] for a, b in itertools.pairwise(records) if b[0] == "push")
    # The other EPP gets each as a load-only record kv_delay later, showing the arrival.
    assert len(loads) == len(pushes)
    assert all(load.running + load.waiting >= 1 for _, load in loads)
    assert sorted(t for t, _ in loads) == pytest.approx(sorted(t + 0.002 for _, t in pushes))


def test_one_epp_or_a_zero_delay_gets_no_load_push(shared_prefix: Any) -> None:
    for name, delay in (("kvswitch", 0.005), ("kvswitch@2", 0.0)):
        router = make_router(name)
        pushed: list[int] = []

        def spy(replica: int, load: Any, now: float, pushed: list[int] = pushed) -> None:
            pushed.append(replica)

        router.load_push = spy  # type: ignore[method-assign]
        run_fleet(shared_prefix, router, PROFILE, 4, load_push_seconds=delay)
        assert pushed == [], name


def test_without_queued_prompts_the_pushes_carry_load_only(shared_prefix: Any) -> None:
    router = make_router("kvswitch@2")
    queued: list[int] = []

    def spy(replica: int, load: Any, now: float, prompts: tuple[Any, ...] = ()) -> None:
        queued.append(len(prompts))

    router.load_push = spy  # type: ignore[method-assign]
    run_fleet(shared_prefix, router, PROFILE, 4, load_push_seconds=0.005, queued_prompts=False)
    assert queued and not any(queued)


def test_a_conversations_next_turn_waits_for_its_previous_and_finds_its_answer_cached() -> None:
    # One conversation whose turns are due every ~50 ms, each answering 40 tokens (~1 s).
    shape = SharedPrefixShape(1, 1, 256, 32, 40, multi_turn=True)
    workload = build_workload(shape, (20.0,), 1.0, load_tokenizer(None), seed=2)
    turns = list(workload.requests)
    assert len(turns) >= 5 and all(t.previous == t.index - 1 for t in turns[1:])
    result = run_fleet(workload, RoundRobin(), PROFILE, 1)
    records = {int(r.request_id): r for r in result.records}
    assert len(records) == len(turns)
    block = PROFILE.block_size
    for turn in turns[1:]:
        before, now = records[turn.previous], records[turn.index]
        assert now.arrival >= before.arrival + before.e2e_s - 1e-9
        assert now.arrival > turn.send_at  # held past its due time
        # The previous prompt and the answer the engine gave are cached in whole blocks, but
        # for the answer's last token (sampled, never fed back, so it has no KV).
        held = len(turns[turn.previous].prompt_ids) + len(turns[turn.previous].answer_ids) - 1
        assert now.cached_tokens == held // block * block
