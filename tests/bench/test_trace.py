"""Trace replay (Mooncake JSONL) and the bursty arrival shape."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from kvswitch.bench.cli import _workload, add_arguments
from kvswitch.bench.fleet import make_router, run_fleet
from kvswitch.bench.trace import (
    TraceError,
    ideal_hit_ratio,
    ideal_prefix_hit_ratio,
    load_trace,
    read_mooncake,
)
from kvswitch.bench.workloads import (
    Arrivals,
    BenchRequest,
    SharedPrefixShape,
    build_workload,
    word_token_ids,
)
from kvswitch.engine.sim.profiles import get_profile
from kvswitch.tokenization import load_tokenizer

TOKENIZER = load_tokenizer(None)
ROWS = [
    {"timestamp": 0, "input_length": 1000, "output_length": 8, "hash_ids": [0, 1]},
    {"timestamp": 0, "input_length": 1500, "output_length": 8, "hash_ids": [0, 1, 2]},
    {"timestamp": 2500, "input_length": 700, "output_length": 8, "hash_ids": [0, 3]},
    {"timestamp": 4000, "input_length": 5000, "output_length": 100, "hash_ids": [4] * 10},
    {"timestamp": 9000, "input_length": 600, "output_length": 8, "hash_ids": [5, 6]},
]


def _trace(tmp_path: Path, rows: list[object] = ROWS) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_equal_block_ids_share_a_prefix_and_the_last_block_is_cut(tmp_path: Path) -> None:
    workload = load_trace(_trace(tmp_path), TOKENIZER, max_model_len=100_000)
    a, b, c = (r.prompt_ids for r in workload.requests[:3])
    assert (len(a), len(b), len(c)) == (1000, 1500, 700)
    assert a == b[:1000]  # ids 0, 1 then 1 cut to 488 tokens
    assert a[:512] == c[:512] and a[512:700] != c[512:700]
    words = set(word_token_ids(TOKENIZER)[0])
    assert set(a) <= words
    assert TOKENIZER.encode(workload.text(workload.requests[0])) == list(a)
    again = load_trace(_trace(tmp_path), TOKENIZER, max_model_len=100_000)
    assert [r.prompt_ids for r in again.requests] == [r.prompt_ids for r in workload.requests]


def test_slice_speedup_and_rows_too_long_are_reported(tmp_path: Path) -> None:
    workload = load_trace(_trace(tmp_path), TOKENIZER, start=2.0, duration=8.0, speedup=2.0,
                          max_model_len=4096)
    assert workload.skipped == (3,)  # 5,100 tokens > 4,096: listed, not replayed
    assert [r.user for r in workload.requests] == [2, 4]  # `user` keeps the trace row
    assert [r.send_at for r in workload.requests] == [0.25, 3.5]
    assert [r.max_tokens for r in workload.requests] == [8, 8]
    assert workload.meta == {"rows": 3, "replayed": 2, "skipped": 1}


def test_ideal_hit_ratio_counts_leading_blocks_seen_before(tmp_path: Path) -> None:
    rows = read_mooncake(_trace(tmp_path))[:3]
    # row 1 reuses blocks 0, 1 (1,024 tokens); row 2 reuses block 0 (512).
    assert ideal_hit_ratio(rows) == pytest.approx((1024 + 512) / (1000 + 1500 + 700))
    prompts = [(1, 2) * 16, (1, 2) * 16 + (3,) * 16, (5,) * 32]
    requests = [BenchRequest(i, 0, 1.0, 0.0, 0, 0, p, 1, 0) for i, p in enumerate(prompts)]
    assert ideal_prefix_hit_ratio(requests, 16) == pytest.approx(32 / (32 + 48 + 32))
    # An answer is cached with its prompt (but its last token): the next turn hits it too.
    turn = BenchRequest(0, 0, 1.0, 0.0, 0, 0, (1, 2) * 16, 17, 0, answer_ids=(7,) * 17)
    after = BenchRequest(1, 0, 1.0, 0.0, 0, 0, (1, 2) * 16 + (7,) * 17 + (8,) * 15, 1, 0, 0)
    assert ideal_prefix_hit_ratio([turn, after], 16) == pytest.approx(48 / (32 + 64))


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": []}', "timestamp"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "x"}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-3]}', "hash_ids"),
    ("[1, 2]", "expected an object"),
])
def test_malformed_rows_are_errors_naming_the_line(tmp_path: Path, line: str,
                                                   message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=f"line 2: .*{message}"):
        read_mooncake(path)


def test_a_trace_replays_in_the_fleet_with_every_request_accounted_for(tmp_path: Path) -> None:
    workload = load_trace(_trace(tmp_path), TOKENIZER, max_model_len=4096)
    profile = get_profile("qwen3-32b-2xh100")
    result = run_fleet(workload, make_router("kvswitch"), profile, 2)
    assert len(result.records) == len(workload.requests) == 4
    assert result.records and all(r.finish_reason == "length" for r in result.records)


def test_bench_cli_builds_a_trace_workload(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--trace", str(_trace(tmp_path)), "--trace-duration", "5",
                              "--speedup", "0.5", "--profile", "qwen3-32b-2xh100"])
    workload = _workload(args)
    assert [r.send_at for r in workload.requests] == [0.0, 0.0, 5.0, 8.0]


def test_bursts_arrive_together_at_the_same_mean_rate() -> None:
    shape = SharedPrefixShape(4, 4, 64, 16, 4)
    bursty = build_workload(shape, (20.0,), 200.0, TOKENIZER, seed=1,
                            arrivals_shape=Arrivals("bursts", 10, 50))
    sizes = Counter(r.send_at for r in bursty.requests).values()
    assert min(sizes) >= 10 and max(sizes) <= 50
    assert 0.6 < len(bursty.requests) / (20.0 * 200.0) < 1.4
    poisson = build_workload(shape, (20.0,), 200.0, TOKENIZER, seed=1)
    assert max(Counter(r.send_at for r in poisson.requests).values()) == 1
    with pytest.raises(ValueError):
        Arrivals("bursts", 0, 5)
