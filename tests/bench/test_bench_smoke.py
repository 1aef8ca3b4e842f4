"""`kvswitch bench` end to end on a tiny configuration: real engines, Envoy, the EPP, the oracle.

Non-streamed (`--no-stream`), so the headline numbers come from the engines' request logs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvswitch.bench.workloads import PRESETS, answer_text, build_workload
from kvswitch.tokenization import load_tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_workload_is_exact_and_repeatable() -> None:
    tokenizer = load_tokenizer(None)
    preset = PRESETS["tiny"]
    a = build_workload(preset.shape, preset.qps, preset.stage_duration, tokenizer, seed=3)
    b = build_workload(preset.shape, preset.qps, preset.stage_duration, tokenizer, seed=3)
    assert a.requests == b.requests and a.requests
    shape = preset.shape
    for request in a.requests[:10]:
        assert len(request.prompt_ids) == shape.system_prompt_len + shape.question_len
        # Real text that tokenizes back to exactly the prompt's ids.
        assert tokenizer.encode(a.text(request)) == list(request.prompt_ids)
    same_group = [r for r in a.requests if r.group == a.requests[0].group]
    assert all(r.prompt_ids[:shape.system_prompt_len] ==
               same_group[0].prompt_ids[:shape.system_prompt_len] for r in same_group)
    times = [r.send_at for r in a.requests]
    assert times == sorted(times) and times[-1] < preset.stage_duration * len(preset.qps)


def test_multi_turn_prompts_grow_within_a_conversation() -> None:
    from kvswitch.bench.workloads import SharedPrefixShape

    shape = SharedPrefixShape(1, 1, 64, 8, 16, multi_turn=True, max_context=200)
    w = build_workload(shape, (5.0,), 4.0, load_tokenizer(None), seed=1)
    lengths = [len(r.prompt_ids) for r in w.requests[:4]]
    assert lengths[:3] == [72, 96, 120]
    first, second = w.requests[0], w.requests[1]
    assert second.prompt_ids[:72] == first.prompt_ids
    # The next turn waits for this one and carries the answer it asks the engine to give.
    assert (first.previous, second.previous) == (-1, 0)
    assert len(first.answer_ids) == first.max_tokens == 16
    assert second.prompt_ids[72:88] == first.answer_ids
    answer = answer_text(first, w.tokenizer)
    assert answer is not None
    assert w.tokenizer.encode(answer) == list(first.answer_ids)


def test_single_turn_requests_wait_for_nothing_and_ask_for_any_answer() -> None:
    w = build_workload(PRESETS["tiny"].shape, (5.0,), 2.0, load_tokenizer(None), seed=1)
    assert all(r.previous == -1 and not r.answer_ids for r in w.requests)
    assert answer_text(w.requests[0], w.tokenizer) is None


@pytest.mark.timeout(240)
def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "kvswitch", "bench", "--preset", "tiny", "--replicas", "3",
            "--profile", "llama3-8b-h100", "--time-scale", "4", "--groups", "6",
            "--targets", "kvswitch,kvswitch@2,round-robin,oracle", "--out", str(out),
            "--no-progress", "--drain-timeout", "30", "--no-stream"]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert report["meta"]["latency_unit"] == "simulated seconds"
    by_name = {t["target"]: t for t in report["targets"]}
    assert set(by_name) == {"kvswitch", "kvswitch@2", "round-robin", "oracle"}
    requests = report["meta"]["requests"]
    for target in by_name.values():
        assert target["overall"]["success_rate"] == 1.0
        assert len(target["steps"]) == 2 == len(target["engine"]["steps"])
        assert sum(target["requests_per_replica"].values()) == requests
        engine = target["engine"]
        # Every request was logged by the engine that served it, in the run's windows.
        assert sum(engine["requests_per_engine"].values()) == requests
        assert sum(s["succeeded"] for s in engine["steps"]) == requests
        assert 0 < engine["overall"]["ttft_p50"] <= engine["overall"]["ttft_p90"]
        assert engine["overall"]["output_tok_s"] > 0
    assert by_name["round-robin"]["overall"]["ttft_p90"] is None  # not streamed: no client TTFT
    rr = by_name["round-robin"]["engine_cache_hit_rate"]
    assert by_name["oracle"]["engine_cache_hit_rate"] > rr
    assert by_name["kvswitch"]["engine_cache_hit_rate"] > rr
    assert by_name["kvswitch@2"]["engine_cache_hit_rate"] > rr  # two EPPs, one Envoy
    summary = (out / "summary.md").read_text()
    assert "| oracle |" in summary and "simulated seconds" in summary
    assert "## Engine-side TTFT p90" in summary
    for name in ("ttft_p90.png", "output_tok_s.png", "cache_and_load.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert len(json.loads((out / "requests.json").read_text())["oracle"]) == \
        report["meta"]["requests"]


@pytest.mark.timeout(240)
def test_bench_smoke_on_sglang_engines(tmp_path: Path) -> None:
    """`--api sglang`: every target drives SGLang engines (pages of 4 tokens), SMG included."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "kvswitch", "bench", "--preset", "tiny", "--replicas", "3",
            "--profile", "llama3-8b-h100", "--time-scale", "4", "--groups", "4",
            "--api", "sglang", "--page-size", "4",
            "--targets", "kvswitch,round-robin,oracle,smg-cache-aware", "--out", str(out),
            "--no-progress", "--drain-timeout", "30", "--no-stream"]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert report["meta"]["api"] == "sglang"
    by_name = {t["target"]: t for t in report["targets"]}
    requests = report["meta"]["requests"]
    for name in ("kvswitch", "round-robin", "oracle"):
        assert by_name[name]["overall"]["success_rate"] == 1.0, name
        assert sum(by_name[name]["engine"]["requests_per_engine"].values()) == requests
    smg = by_name["smg-cache-aware"]
    assert not smg.get("unavailable"), smg.get("unavailable")  # smg is a test dependency
    assert smg["overall"]["success_rate"] == 1.0
    rr = by_name["round-robin"]["engine_cache_hit_rate"]
    assert by_name["kvswitch"]["engine_cache_hit_rate"] > rr
    assert by_name["oracle"]["engine_cache_hit_rate"] > rr


@pytest.mark.timeout(240)
def test_bench_replays_a_trace_and_reports_rows_too_long(tmp_path: Path) -> None:
    rows = [{"timestamp": 250 * i, "input_length": 600 + 100 * (i % 4), "output_length": 8,
             "hash_ids": [0, 1 + i % 3]} for i in range(10)]
    rows.insert(4, {"timestamp": 1000, "input_length": 140_000, "output_length": 8,
                    "hash_ids": list(range(100, 374))})
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "kvswitch", "bench", "--trace", str(trace), "--replicas", "2",
            "--profile", "llama3-8b-h100", "--time-scale", "4", "--targets",
            "round-robin,oracle", "--out", str(out), "--no-progress", "--drain-timeout", "30",
            "--no-stream"]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    trace_meta = report["meta"]["trace"]
    assert trace_meta["skipped_rows"] == [4] and trace_meta["replayed"] == 10
    assert 0 < trace_meta["ideal_hit_ratio"] < 1
    for target in report["targets"]:
        assert target["engine"]["overall"]["succeeded"] == 10, target["target"]
    assert "longer than max_model_len left out" in (out / "summary.md").read_text()
