"""The routing panel's members, its jittered replays, the summary of issue 24's targets over
them, the tail of a step (ttft_tail), its occupancy (step_occupancy), how far its groups spread
(group_spread), when a conversation's later turns are sent (conversation_turns) and a trace
slice's TTFT floor (trace_floor)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvswitch.bench.workloads import PRESETS, Arrivals, build_workload
from kvswitch.engine.request_log import RequestRecord
from kvswitch.tokenization import load_tokenizer
from tests.support.benchmarks import load_script


def test_a_jittered_replay_moves_each_arrival_by_less_than_the_jitter_and_repeats() -> None:
    panel = load_script("routing_panel")
    workload = build_workload(PRESETS["tiny"].shape, (20.0,), 2.0, load_tokenizer(None),
                              arrivals_shape=Arrivals("poisson"))
    replay = panel.jittered(workload, 0.001, seed=3)
    assert panel.jittered(workload, 0.001, seed=3) == replay
    assert panel.jittered(workload, 0.001, seed=4) != replay
    sent = {r.index: r.send_at for r in workload.requests}
    moves = [r.send_at - sent[r.index] for r in replay.requests]
    assert sorted(r.index for r in replay.requests) == sorted(sent)
    assert all(0.0 <= m < 0.001 for m in moves) and max(moves) > 0.0
    assert [r.send_at for r in replay.requests] == sorted(r.send_at for r in replay.requests)
    assert [r.prompt_ids for r in sorted(replay.requests, key=lambda r: r.index)] == \
        [r.prompt_ids for r in sorted(workload.requests, key=lambda r: r.index)]


def _replay(mine: float, best: float, rr: float, smg: float) -> dict[str, Any]:
    def steps(p90: float) -> dict[str, Any]:
        return {"steps": [{"qps": 5.0, "ttft_p90": p90}]}

    return {"meta": {"epp": {"kvswitch": "kvswitch"}, "command": "c", "git": "g", "seed": 0},
            "members": [{"member": "m", "routers": {
                "kvswitch": steps(mine), "oracle-best": steps(best),
                "round-robin": steps(rr), "smg-cache-aware-model": steps(smg)}}]}


def test_targets_are_judged_against_references_of_the_same_replay() -> None:
    replays = load_script("routing_replays")
    # Replay 2's burst is bad for every router: its ratios are what a replay shows.
    summary = replays.summarise([_replay(1.1, 1.0, 1.2, 1.0), _replay(3.3, 2.5, 3.0, 3.5),
                                 _replay(1.0, 1.0, 0.9, 1.0)], tolerance=0.02)
    [row] = summary["kvswitch"]
    assert row["member"] == "m" and row["ttft_p90"] == [1.1, 3.3, 1.0]
    best = row["references"]["oracle-best"]
    assert best["ratios"] == [1.1, 1.32, 1.0]
    assert best["met"] == 2 and best["worst"] == 1.32 and best["target"] == 1.2
    rr = row["references"]["round-robin"]
    assert rr["met"] == 1 and rr["median"] == 1.1
    assert row["references"]["smg-cache-aware-model"]["met"] == 2
    text = replays.markdown(summary, 3, 0.02)
    row_text = "| m | 5 | 1.1 (1-3.3) | 1.10 (1.32), 2/3 | 1.10 (1.11), 1/3 | 1.00 (1.10), 2/3 |"
    assert row_text in text


def test_references_a_replay_lacks_come_from_an_earlier_summary_of_the_same_seeds() -> None:
    replays = load_script("routing_replays")
    earlier = replays.summarise([_replay(1.1, 1.0, 1.2, 1.0), _replay(3.3, 2.5, 3.0, 3.5)],
                                tolerance=0.02)
    written = {"seeds": [1, 2], "summary": earlier}
    saved = replays.saved_references(written)
    assert saved[("m", 5.0, 2, "round-robin")] == 3.0

    def candidate(mine: float, seed: int) -> dict[str, Any]:
        replay = _replay(mine, 0.0, 0.0, 0.0)
        replay["meta"]["seed"] = seed
        replay["members"][0]["routers"] = {"kvswitch": replay["members"][0]["routers"]
                                           ["kvswitch"]}
        return replay

    # The candidate's replays in the other order: each ratio is against its own seed's run.
    [row] = replays.summarise([candidate(2.7, 2), candidate(1.3, 1)], 0.02, saved)["kvswitch"]
    assert row["references"]["round-robin"]["ttft_p90"] == [3.0, 1.2]
    assert row["references"]["round-robin"]["ratios"] == [0.9, 1.0833]
    assert row["references"]["oracle-best"]["ratios"] == [1.08, 1.3]
    assert row["references"]["oracle-best"]["met"] == 1


def test_the_summary_lists_replays_in_seed_order_whatever_the_order_given(
        tmp_path: Path) -> None:
    replays = load_script("routing_replays")
    paths = []
    for seed, mine in ((10, 1.3), (2, 1.1), (1, 1.0)):  # as a shell glob orders s10, s2, s1
        replay = _replay(mine, 1.0, 1.2, 1.0)
        replay["meta"]["seed"] = seed
        paths.append(tmp_path / f"s{seed}.json")
        paths[-1].write_text(json.dumps(replay))
    out = tmp_path / "summary.json"
    assert replays.main([*map(str, paths), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["seeds"] == [1, 2, 10]
    assert written["panels"] == [str(tmp_path / f"s{seed}.json") for seed in (1, 2, 10)]
    assert written["summary"]["kvswitch"][0]["ttft_p90"] == [1.0, 1.1, 1.3]


def test_a_negative_jitter_is_refused_before_anything_runs(capsys: Any) -> None:
    panel = load_script("routing_panel")
    with pytest.raises(SystemExit):
        panel.main(["--jitter-ms", "-1", "--members", "mt-1000-30"])
    assert "--jitter-ms must be >= 0" in capsys.readouterr().err


def test_held_out_members_run_only_when_named() -> None:
    panel = load_script("routing_panel")
    held_out = [m.name for m in panel.MEMBERS if m.held_out]
    assert held_out == ["trace-300-x1.5", "trace-600-x1.5", "trace-1200-x1.5", "trace-1500-x1.5",
                        *(f"synthetic-{start}-x{speedup}" for start in (0, 400, 800)
                          for speedup in ("1", "1.5"))]
    default = [m.name for m in panel.select_members("")]
    assert "trace-0-x1.5" in default and not set(held_out) & set(default)
    named = panel.select_members("trace-1200-x1.5, trace-0-x1")
    assert [m.name for m in named] == ["trace-0-x1", "trace-1200-x1.5"]  # panel order
    with pytest.raises(ValueError, match="unknown members: \\['trace-1-x1'\\]"):
        panel.select_members("trace-1-x1")


def _built(*names: str) -> list[Any]:
    """The named panel members' workloads, at scale 1."""
    panel = load_script("routing_panel")
    tokenizer = load_tokenizer(None)
    member = {m.name: m for m in panel.MEMBERS}
    return [member[name].build(tokenizer, 1.0) for name in names]


def test_a_held_out_slice_replays_its_own_part_of_the_trace() -> None:
    late, early = _built("trace-1200-x1.5", "trace-0-x1.5")
    assert late.requests and max(r.send_at for r in late.requests) < 120.0  # 180 s at 1.5x
    assert {r.prompt_ids for r in late.requests}.isdisjoint(r.prompt_ids for r in early.requests)


def test_a_synthetic_member_replays_the_synthetic_trace_at_its_speed() -> None:
    recorded, faster, conversation, late = _built(
        "synthetic-400-x1", "synthetic-400-x1.5", "trace-300-x1.5", "synthetic-800-x1")
    assert sorted(r.prompt_ids for r in faster.requests) == \
        sorted(r.prompt_ids for r in recorded.requests)
    assert 170.0 < max(r.send_at for r in recorded.requests) < 180.0
    assert 110.0 < max(r.send_at for r in faster.requests) < 120.0
    assert {r.prompt_ids for r in recorded.requests}.isdisjoint(
        r.prompt_ids for r in conversation.requests)
    # Rows too long for the 128k profile are listed by the slice they fall in (the file's rows
    # 3082, 3208, 3685 and 3791 arrive at 803-973 s), not dropped silently.
    assert late.skipped == (3082, 3208, 3685, 3791)


def _record(i: int, ttft: float, prompt: int, cached: int) -> RequestRecord:
    return RequestRecord(request_id=str(i), arrival_wall=0.0, finish_wall=1.0, arrival=0.0,
                         e2e_s=1.0, ttft_s=ttft, queue_s=0.01 * i, itl_s=0.02,
                         prompt_tokens=prompt, cached_tokens=cached, completion_tokens=10,
                         finish_reason="stop", stream=False)


def test_the_tail_is_tallied_by_prompt_and_uncached_tokens() -> None:
    tail = load_script("ttft_tail").tail
    # 18 fast first turns, one slow one that missed its prefix, one slower second turn.
    records = [_record(i, 0.2, 4000, 1000) for i in range(18)]
    records += [_record(18, 0.25, 4010, 0), _record(19, 0.3, 7960, 4000)]
    result = tail(records)
    assert result["requests"] == 20 and result["tail"] == 2
    assert abs(result["ttft_p90"] - 0.205) < 1e-9  # a tenth of the way from 0.2 to 0.25
    kinds = sorted((k["prompt"], k["uncached"], k["in_tail"], k["in_step"])
                   for k in result["kinds"])
    assert kinds == [(4000, 4000, 1, 1), (8000, 4000, 1, 1)]  # the 18 fast ones are not in it
    assert result["step_kinds"] == [{"prompt": 4000, "uncached": 3000, "count": 18},
                                    {"prompt": 4000, "uncached": 4000, "count": 1},
                                    {"prompt": 8000, "uncached": 4000, "count": 1}]
    slow = next(k for k in result["kinds"] if k["prompt"] == 8000)
    assert slow["ttft_min"] == slow["ttft_max"] == 0.3 and abs(slow["queue_mean"] - 0.19) < 1e-9


def test_a_later_turn_is_told_apart_and_counted_early_when_sent_before_its_previous_ended(
) -> None:
    from kvswitch.bench.workloads import SharedPrefixShape

    turns = load_script("conversation_turns")
    # One group, two users: each user's second request carries its first turn's history.
    shape = SharedPrefixShape(1, 2, 32, 8, 16, multi_turn=True)
    workload = build_workload(shape, (50.0,), 1.0, load_tokenizer(None))
    previous = turns.previous_turns(workload)
    last: dict[int, str] = {}
    expected = {}
    for r in workload.requests:
        if r.user in last:
            expected[str(r.index)] = last[r.user]
        last[r.user] = str(r.index)
    assert previous == expected and len(previous) >= 2
    later = sorted(previous, key=int)
    first = [str(r.index) for r in workload.requests if str(r.index) not in previous]
    # Every record arrives at 0 s; the first later turn's previous turn ends at 0.5 s (sent
    # early), the second's before 0 s (sent after it ended); the later turns are the slowest.
    ended = {rid: -1.0 for rid in first + later}
    ended[previous[later[0]]] = 0.5
    records = [_record(int(rid), 0.1, 40, 0) for rid in first]
    records += [_record(int(rid), 0.3, 80, 40) for rid in later[:2]]
    found = turns.tally(records, {rid: previous[rid] for rid in later[:2]}, ended)
    assert found["later_turns"] == 2 and found["sent_before_previous_ended"] == 1
    assert found["tail"] == 2 and found["later_in_tail"] == 2 and found["early_in_tail"] == 1
    # A previous turn that never ended counts as not ended.
    del ended[previous[later[1]]]
    assert turns.tally(records, {rid: previous[rid] for rid in later[:2]},
                       ended)["sent_before_previous_ended"] == 2


def test_the_floor_prefills_each_row_alone_in_chunks_after_what_earlier_rows_left(
        tmp_path: Any) -> None:
    floor = load_script("trace_floor")
    from kvswitch.bench.trace import read_mooncake
    from kvswitch.engine.sim.profiles import get_profile

    profile = get_profile("qwen3-32b-2xh100-128k")
    chunk = profile.max_num_batched_tokens
    two_chunks = floor.alone_seconds(profile, chunk + 10)
    assert two_chunks == pytest.approx(
        profile.step_seconds(chunk, 0, prefill_context=chunk,
                             prefill_pairs=chunk * (chunk + 1) // 2)
        + profile.step_seconds(10, 0, prefill_context=chunk + 10,
                               prefill_pairs=10 * chunk + 55))
    assert floor.alone_seconds(profile, 1024, cached=1024) == 0.0
    # Row 1 repeats row 0's two blocks and adds one; row 2 (at 200 s) is outside the slice.
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 4, '
                     '"hash_ids": [1, 2]}\n'
                     '{"timestamp": 1000, "input_length": 1500, "output_length": 4, '
                     '"hash_ids": [1, 2, 3]}\n'
                     '{"timestamp": 200000, "input_length": 9000, "output_length": 4, '
                     '"hash_ids": [9]}\n')
    result = floor.floors(read_mooncake(trace), profile, 0.0, 180.0)
    assert result["rows"] == 2
    first, second = floor.alone_seconds(profile, 1024), floor.alone_seconds(profile, 1500)
    assert result["no_cache"]["p50"] == pytest.approx((first + second) / 2)
    warm = floor.alone_seconds(profile, 1500, cached=1024)
    assert result["ideal_cache"]["p50"] == pytest.approx((first + warm) / 2)


def test_a_miss_is_routed_past_a_holder_only_when_a_replica_really_held_more() -> None:
    from kvswitch.epp.kvindex import KvBlockIndex
    from tests.support.kvblocks import stored

    past = load_script("routed_past_cache")
    index = KvBlockIndex(16)
    prompt = list(range(1, 65))  # 4 blocks
    index.add_endpoint("a")
    index.add_endpoint("b")
    index.apply("a", [stored(prompt[:32])])  # a holds 2 blocks, by its KV events
    index.speculate("b", index.block_hashes(prompt), ttl=60.0)  # b only speculatively
    assert past.held_tokens(index, prompt) == 32
    assert past.held_tokens(index, prompt, "a") == 32
    assert past.held_tokens(index, prompt, "b") == 0
    assert past.held_tokens(index, [9, *prompt[1:]]) == 0  # another first block: nowhere

    def record(cached: int) -> RequestRecord:
        return _record(0, 0.2, 64, cached)

    assert past.classify(record(32), (32, 32), 16) == "served"
    assert past.classify(record(16), (32, 32), 16) == "served"  # a last token is recomputed
    assert past.classify(record(0), (32, 0), 16) == "routed past a holder"
    assert past.classify(record(0), (32, 32), 16) == "lost while queued"  # evicted meanwhile
    assert past.classify(record(0), (0, 0), 16) == "held nowhere"
    rows = past.tally([_record(1, 0.2, 64, 0), _record(2, 0.2, 64, 32),
                       _record(3, 0.2, 64, 0)],
                      {"1": (32, 16), "2": (32, 32), "3": (32, 32)}, 16, {"3"})
    assert rows["routed past a holder"] == {"requests": 1, "uncached_tokens": 64, "saturated": 0}
    assert rows["lost while queued"] == {"requests": 1, "uncached_tokens": 64, "saturated": 1}
    assert rows["served"] == {"requests": 1, "uncached_tokens": 32, "saturated": 0}


def test_step_occupancy_weighs_each_step_by_its_time_in_the_window() -> None:
    from kvswitch.bench.fleet.replica import Replica
    from kvswitch.engine.sim.profiles import get_profile
    from kvswitch.engine.sim.scheduler import StepResult

    occupancy = load_script("step_occupancy").Occupancy(2, 1.0, 3.0)
    replica = Replica(1, get_profile("qwen3-32b-2xh100"))
    occupancy(replica, 0.0, StepResult(2.0, 0, 4, scheduled=4))  # 1 s inside the window
    occupancy(replica, 2.5, StepResult(1.0, 0, 2, scheduled=2))  # 0.5 s inside
    occupancy(replica, 3.0, StepResult(1.0, 0, 9, scheduled=9))  # after the window
    idle, busy = occupancy.means()
    assert busy["running"] == pytest.approx((4 * 1.0 + 2 * 0.5) / 2.0)
    assert idle == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}


def test_group_spread_counts_the_replicas_each_group_went_to() -> None:
    spread = load_script("group_spread").spread
    # Group 1 on replicas 0, 0, 1; group 2 sent once (left out); group 3 twice on replica 2.
    found = spread({1: [0, 0, 1], 2: [3], 3: [2, 2], 4: [0, 1, 2, 3, 4]})
    assert found["groups"] == 3
    assert found["replicas_per_group"] == (2 + 1 + 5) / 3
    assert found["groups_on"] == {"1": 1, "2": 1, "4+": 1}
    assert abs(found["top_replica_share"] - (2 / 3 + 1 + 1 / 5) / 3) < 1e-12
    assert spread({5: [1]})["groups"] == 0
