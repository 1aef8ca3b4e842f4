"""Fast unit tests of the bench's pieces (no processes)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvswitch.bench.client import RequestResult
from kvswitch.bench.cpu import CpuMonitor, process_cpu_seconds, role
from kvswitch.bench.engines import EngineCounters, parse_counters
from kvswitch.bench.report import target_summary
from kvswitch.bench.runner import TargetRun
from kvswitch.bench.targets import GatewayTarget, bundled_config, make_target, safe_label


def test_absolute_config_path_target_gets_a_file_safe_label(tmp_path: Path) -> None:
    config = tmp_path / "my config.yaml"
    config.write_text(bundled_config("kvswitch-weighted.yaml").read_text())
    target = make_target(f"kvswitch:{config}")
    assert isinstance(target, GatewayTarget) and target.epp_config == config
    label = safe_label(target.name)
    assert "/" not in label and ":" not in label and " " not in label
    assert label.endswith("my_config.yaml")


def test_named_configs_resolve_to_bundled_files() -> None:
    for spec, file in (("kvswitch-weighted", "kvswitch-weighted.yaml"),
                       ("kvswitch:kvswitch-weighted", "kvswitch-weighted.yaml"),
                       ("kvswitch-approximate", "kvswitch-approximate.yaml")):
        target = make_target(spec)
        assert isinstance(target, GatewayTarget)
        assert target.epp_config == bundled_config(file) and target.epp_config.is_file()
    with pytest.raises(ValueError):
        make_target("kvswitch:/no/such/config.yaml")


def test_engine_histogram_sums_are_parsed() -> None:
    text = "\n".join([
        "# HELP vllm:time_to_first_token_seconds x",
        'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0',
        'vllm:time_to_first_token_seconds_sum{model_name="m"} 1.5',
        'vllm:time_to_first_token_seconds_count{model_name="m"} 4.0',
        'vllm:prefix_cache_hits_total{model_name="m"} 10.0',
    ])
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
        monitor = CpuMonitor(lambda: [], interval=0.05)
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
