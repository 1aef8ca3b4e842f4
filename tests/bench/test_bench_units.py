"""Fast unit tests of the bench's pieces (no processes)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvswitch.bench.client import RequestResult
from kvswitch.bench.cpu import CpuMonitor, process_cpu_seconds, role
from kvswitch.bench.engine_report import (
    bucket,
    clock_slip,
    engine_summary,
    output_tok_s,
    step_summary,
)
from kvswitch.bench.engines import EngineCounters, parse_counters
from kvswitch.bench.report import markdown, target_summary
from kvswitch.bench.runner import TargetRun
from kvswitch.bench.targets import GatewayTarget, bundled_config, make_target, safe_label
from kvswitch.bench.workloads import answer_text
from kvswitch.engine.request_log import RequestRecord


def test_absolute_config_path_target_gets_a_file_safe_label(tmp_path: Path) -> None:
    config = tmp_path / "my config.yaml"
    config.write_text(bundled_config("kvswitch-estimated-ttft.yaml").read_text())
    target = make_target(f"kvswitch:{config}")
    assert isinstance(target, GatewayTarget) and target.epp_config == config
    label = safe_label(target.name)
    assert "/" not in label and ":" not in label and " " not in label
    assert label.endswith("my_config.yaml")


def test_named_configs_resolve_to_bundled_files() -> None:
    for spec, file in (("kvswitch-estimated-ttft", "kvswitch-estimated-ttft.yaml"),
                       ("kvswitch:kvswitch-estimated-ttft", "kvswitch-estimated-ttft.yaml"),
                       ("kvswitch:kvswitch", "kvswitch.yaml"),
                       ("kvswitch-approximate", "kvswitch-approximate.yaml")):
        target = make_target(spec)
        assert isinstance(target, GatewayTarget)
        assert target.epp_config == bundled_config(file) and target.epp_config.is_file()
    with pytest.raises(ValueError):
        make_target("kvswitch:/no/such/config.yaml")


def test_the_kvswitch_target_is_the_kvswitch_up_default_profile() -> None:
    import yaml

    from kvswitch.launcher import DEFAULT_EPP_CONFIG

    target = make_target("kvswitch")
    assert isinstance(target, GatewayTarget) and target.epp_config is not None
    if target.epp_config.name == "kvswitch.yaml":  # the precise plugin is registered
        assert yaml.safe_load(target.epp_config.read_text()) == DEFAULT_EPP_CONFIG
    weights = {p.get("pluginRef"): p.get("weight") for p in yaml.safe_load(
        bundled_config("kvswitch-approximate.yaml").read_text())["schedulingProfiles"][0][
        "plugins"]}
    assert weights["prefix-cache-scorer"] == 3 and weights["queue-scorer"] == 2


def _rec(rid: str, wall: float, arrival: float, e2e: float, ttft: float = 0.5, tokens: int = 100,
         reason: str = "length", prompt: int = 1000, cached: int = 500) -> RequestRecord:
    return RequestRecord(rid, wall, wall + e2e, arrival, e2e, ttft, 0.1, 0.01, prompt, cached,
                         tokens, reason, False)


def test_records_are_bucketed_by_wall_arrival_into_step_windows() -> None:
    # Steps of 10 simulated s at time scale 2: 5 wall s each, from wall 100.
    records = [_rec("early", 99.0, 0, 1), _rec("a", 100.0, 0, 1), _rec("b", 104.9, 0, 1),
               _rec("c", 105.0, 0, 1), _rec("late", 130.0, 0, 1)]
    steps = bucket(records, 100.0, 5.0, 2)
    assert [[r.request_id for r in s] for s in steps] == [["a", "b"], ["c", "late"]]


def test_output_tok_s_is_inference_perfs_tokens_over_first_arrival_to_last_finish() -> None:
    # Time scale 2, start at wall 100: arrivals at 0 and 4 simulated s; finishes at 10 and 24.
    records = [_rec("a", 100.0, 50.0, 10.0, tokens=100), _rec("b", 102.0, 999.0, 20.0, tokens=300),
               _rec("failed", 101.0, 7.0, 1.0, tokens=50, reason="abort")]
    # Engines' own clock origins (50, 999, 7) do not matter: the common timeline is wall x X.
    assert output_tok_s(records, 100.0, 2.0) == pytest.approx((100 + 300) / 24.0)
    assert output_tok_s([], 100.0, 2.0) is None


def test_step_summary_uses_successful_requests_for_latency_and_cache_hit() -> None:
    records = [_rec("a", 0.0, 0, 10, ttft=1.0, cached=600), _rec("b", 0.0, 0, 10, ttft=3.0,
                                                                  cached=200),
               _rec("x", 0.0, 0, 1, ttft=100.0, reason="abort", cached=1000)]
    step = step_summary(records, 0.0, 1.0)
    assert (step["requests"], step["succeeded"]) == (3, 2)
    assert step["ttft_p50"] == pytest.approx(2.0) and step["ttft_p90"] == pytest.approx(2.8)
    assert step["cache_hit_rate"] == pytest.approx(0.4)


def test_clock_slip_is_wall_time_times_scale_minus_engine_time() -> None:
    # 10 wall s at time scale 2 = 20 simulated s, but the engine clock advanced 18.
    slip = clock_slip([_rec("a", 100.0, 5.0, 1), _rec("b", 110.0, 23.0, 1)], 2.0)
    assert slip == pytest.approx({"slip_s": 2.0, "span_s": 20.0, "slip_fraction": 0.1})
    assert clock_slip([_rec("a", 100.0, 5.0, 1)], 2.0) is None


def test_engine_summary_and_markdown_headline() -> None:
    by_engine = {"e1": (_rec("a", 100.0, 0.0, 8.0), _rec("a2", 102.0, 4.0, 8.0),
                        _rec("b", 106.0, 12.0, 8.0)),
                 "e2": (_rec("c", 101.0, 40.0, 8.0),)}
    summary = engine_summary(by_engine, 100.0, 2.0, 10.0, (1.0, 2.0))
    assert [s["requests"] for s in summary["steps"]] == [3, 1]
    assert summary["requests_per_engine"] == {"e1": 3, "e2": 1}
    assert summary["clock_slip"]["e2"] is None
    assert summary["clock_slip_max_s"] == pytest.approx(0.0)
    assert summary["steps"][0]["clock_slip_max_fraction"] == pytest.approx(0.0)
    assert summary["steps"][1]["clock_slip_max_fraction"] is None  # one record per engine
    results = tuple(RequestResult(i, i // 3, 1.0, ok=True, e2e=8.0, output_tokens=100)
                    for i in range(4))
    run = TargetRun("t", results, {}, 1.0, engine_records=by_engine, start_wall=100.0,
                    stream=False)
    target = target_summary(run, (1.0, 2.0), 10.0, 2.0)
    assert target["engine"]["steps"][0]["ttft_p90"] == pytest.approx(0.5)
    assert target["steps"][0]["ttft_p90"] is None  # not streamed: no client-side TTFT
    meta = {"preset": "p", "command": "c", "replicas": 2, "profile": "x", "time_scale": 2.0,
            "requests": 3, "seed": 0, "qps": [1.0, 2.0], "stage_duration": 10.0,
            "stream": False}
    text = markdown({"meta": meta, "targets": [target]})
    assert "## Engine-side TTFT p90 (s) / output tok/s per QPS step" in text
    assert text.index("## Engine-side") < text.index("## Client-side")


def test_engine_histogram_sums_are_parsed() -> None:
    lines = ["# HELP vllm:time_to_first_token_seconds x",
             'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0',
             'vllm:time_to_first_token_seconds_sum{model_name="m"} 1.5',
             'vllm:time_to_first_token_seconds_count{model_name="m"} 4.0',
             'vllm:prefix_cache_hits_total{model_name="m"} 10.0']
    text = "\n".join(lines)
    counters = parse_counters(text)
    assert (counters.ttft_sum, counters.ttft_count, counters.cache_hits) == (1.5, 4.0, 10.0)


def test_summary_puts_engine_and_client_itl_e2e_and_tail_side_by_side() -> None:
    results = (
        RequestResult(0, 0, 1.0, ok=True, ttft=0.5, e2e=10.5, itl=0.01, output_tokens=1001,
                      tail=0.002),
        RequestResult(1, 0, 1.0, ok=True, ttft=0.5, e2e=2.5, itl=0.02, output_tokens=101,
                      tail=0.004),
        RequestResult(2, 0, 1.0, ok=False, error="x"),
    )
    counters = {"e": EngineCounters(itl_sum=11.0, itl_count=1100.0, e2e_sum=12.0,
                                    e2e_count=2.0)}
    summary = target_summary(TargetRun("t", results, counters, 1.0), (1.0,), 10.0)
    assert summary["engine_itl_mean"] == pytest.approx(0.01)
    assert summary["client_itl_mean"] == pytest.approx((10.0 + 2.0) / 1100)
    assert (summary["engine_e2e_mean"], summary["client_e2e_mean"]) == (6.0, 6.5)
    assert summary["client_tail_mean"] == pytest.approx(0.003)


def test_cpu_monitor_accounts_the_client() -> None:
    assert process_cpu_seconds(os.getpid()) is not None
    assert role("engine-3") == "engine" and role("epp-kvswitch") == "epp"

    async def run() -> dict:
        monitor = CpuMonitor(list, interval=0.05)
        monitor.start()
        end = asyncio.get_running_loop().time() + 0.2
        while asyncio.get_running_loop().time() < end:  # burn a little CPU
            sum(range(10_000))
            await asyncio.sleep(0)
        return await monitor.stop()

    summary = asyncio.run(run())
    assert summary["available"] and summary["busiest_process"] == "client"
    assert 0 < summary["bench_cores_by_role"]["client"] <= 1.5
    assert summary["load_avg_1m_max"] >= 0


def test_oracle_sees_prefill_end_in_kv_events_or_at_its_estimate_without_streaming() -> None:
    from kvswitch.bench.oracle import OracleRouter
    from kvswitch.bench.workloads import BenchRequest
    from kvswitch.engine.sim.profiles import get_profile
    from kvswitch.epp.kvindex import BlocksStored, KvBlockIndex, StoredBlock

    now = [0.0]
    index = KvBlockIndex(16)
    router = OracleRouter(["a", "b"], get_profile("qwen3-32b-2xh100"), index, clock=lambda: now[0])
    prompt = tuple(range(1, 65))  # 4 full blocks

    def request(i: int) -> BenchRequest:
        return BenchRequest(i, 0, 1.0, 0.0, 0, 0, prompt, 10, 64)

    engine = router.choose(request(0))
    assert router.queues[engine].pending_prefill == 64 and router.queues[engine].decoding == 0
    # The prompt sent counts as soon cached there (its blocks hashed as the index hashes them).
    assert router.pending.match(index.block_hashes(prompt), ["a", "b"])[engine] == 4
    router.choose(request(1))  # nothing stored yet: request 0 is still prefilling
    assert router.queues[engine].waiting.keys() >= {0}
    blocks = tuple(StoredBlock.of(100 + i, prompt[i * 16:(i + 1) * 16]) for i in range(4))
    index.apply(engine, [BlocksStored(blocks, None, 16)])  # the engine computed the prompt
    third = router.choose(request(2))
    assert 0 not in router.queues[engine].waiting and router.queues[engine].decoding >= 1
    assert third == engine  # cached there now
    # Request 2's prompt was cached when sent: no event will come, its estimate settles it.
    assert 2 in router.queues[engine].waiting
    now[0] = 10.0
    router.choose(request(3))
    assert 2 not in router.queues[engine].waiting


def test_markdown_compares_kvswitch_with_the_oracle_and_round_robin_per_step() -> None:
    def target(name: str, ttft: float, tok: float) -> dict:
        step = {"ttft_p90": ttft, "output_tok_s": tok}
        return {"target": name, "steps": [], "engine": {"steps": [step]}}

    from kvswitch.bench.report import _ratios

    lines = _ratios([target("kvswitch", 0.5, 1000.0), target("oracle", 0.4, 1100.0),
                     target("round-robin", 100.0, 400.0)], [30.0])
    assert lines[-1] == "| 30 | 1.25x | 200x | 2.5x |"
    assert _ratios([target("oracle", 0.4, 1.0)], [30.0]) == []


def _conversation() -> Any:
    from kvswitch.bench.workloads import SharedPrefixShape, build_workload
    from kvswitch.tokenization import load_tokenizer

    # One conversation, a turn due every ~100 ms of simulated time.
    shape = SharedPrefixShape(1, 1, 64, 8, 16, multi_turn=True)
    return build_workload(shape, (10.0,), 1.0, load_tokenizer(None), seed=1)


async def test_the_runner_sends_a_next_turn_after_its_previous_and_asks_for_its_answer(
) -> None:
    from kvswitch.bench.runner import _drive

    workload = _conversation()
    assert len(workload.requests) >= 4
    log: list[tuple[str, int, float, str | None]] = []

    class Answering:
        """An OpenAI-HTTP-shaped target whose every answer takes 0.3 s (time scale 1)."""

        name, text_prompts = "answering", False

        def choose(self, request: Any) -> tuple[str, str]:
            return "", ""

        def finished(self, request: Any, result: RequestResult) -> None:
            pass

        async def send_request(self, request: Any, text: str, time_scale: float,
                               timeout: float, stream: bool = True,
                               answer: str | None = None) -> RequestResult:
            loop = asyncio.get_running_loop()
            log.append(("sent", request.index, loop.time(), answer))
            await asyncio.sleep(0.3)
            log.append(("ended", request.index, loop.time(), None))
            return RequestResult(request.index, request.stage, request.qps, ok=True)

    started = asyncio.get_running_loop().time()
    results = await _drive(Answering(), workload, None, "run", 1.0,  # type: ignore[arg-type]
                           30.0, 30.0, False, True, time.perf_counter())
    assert [r.ok for r in results] == [True] * len(workload.requests)
    at = {(kind, index): t for kind, index, t, _ in log}
    for turn in workload.requests[1:]:
        assert at[("sent", turn.index)] >= at[("ended", turn.previous)]
    # Open loop would have sent them all within the 1 s of the schedule; closed, they queue.
    assert at[("sent", workload.requests[-1].index)] - started >= 0.3 * (
        len(workload.requests) - 1)
    answers = {index: answer for kind, index, _, answer in log if kind == "sent"}
    assert all(answers[r.index] == answer_text(r, workload.tokenizer) for r in workload.requests)


def test_an_answer_is_asked_for_as_a_one_option_choice_or_a_literal_regex() -> None:
    import re

    from kvswitch.bench.client import generate_request

    workload = _conversation()
    first = workload.requests[0]
    answer = answer_text(first, workload.tokenizer)
    assert answer is not None
    vllm = generate_request(first, "run", api="vllm", answer=answer)
    assert list(vllm.sampling_params.choice.choices) == [answer]
    sglang = generate_request(first, "run", api="sglang", answer=answer)
    assert re.fullmatch(sglang.sampling_params.regex, answer)
    assert sglang.sampling_params.regex == re.escape(answer)
    plain = generate_request(first, "run", api="vllm")
    assert plain.sampling_params.WhichOneof("constraint") is None


async def test_the_simulated_engine_says_the_answer_and_the_next_turn_finds_it_cached() -> None:
    import json

    from tests.engine.sim.conftest import collect, make_engine, request, tokens_of

    workload = _conversation()
    first, second = workload.requests[0], workload.requests[1]
    engine = make_engine(mode="random")
    await engine.start()
    try:
        said = await collect(engine.generate(request(
            "a", list(first.prompt_ids), max_tokens=first.max_tokens, ignore_eos=True,
            temperature=0.0,
            constraint=("choice", json.dumps([answer_text(first, workload.tokenizer)])))))
        assert tokens_of(said) == list(first.answer_ids)
        after = await collect(engine.generate(request("b", list(second.prompt_ids),
                                                      max_tokens=1)))
    finally:
        await engine.stop()
    # All of the first turn but its answer's last token (sampled, never fed back) is cached.
    held = len(first.prompt_ids) + len(first.answer_ids) - 1
    assert after[0].cached_tokens == held // 16 * 16
