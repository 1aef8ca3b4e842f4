"""The roofline step-time model's physics: contexts cost time, KV capacity follows from memory,
and the linear fit stays available unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from kvswitch.engine.sim import SimConfig
from kvswitch.engine.sim.catalog import EFFICIENCY, GPUS, MODELS
from kvswitch.engine.sim.profiles import PROFILES, get_profile
from kvswitch.engine.sim.roofline import GIB, Roofline

from .conftest import add, make_engine

QWEN = "qwen3-32b-2xh100"


def decode_step(batch: int, context: int, profile: str = QWEN) -> float:
    return get_profile(profile).step_seconds(0, batch, decode_context=batch * context)


def test_model_configs_add_up_to_the_published_parameter_counts() -> None:
    for model in MODELS.values():
        assert model.derived_params == pytest.approx(model.params, rel=0.01), model.name
    # 2 (K and V) x 64 layers x 8 KV heads x 128 x 2 bytes: 256 KiB, 128 KiB per GPU at TP=2.
    assert MODELS["qwen3-32b"].kv_bytes_per_token == 256 * 1024


def test_inter_token_latency_grows_with_the_running_contexts() -> None:
    # Same batch of 64, contexts of 1k vs 8k: the step reads 8x the KV on top of the weights
    # and the per-sequence work (about 2-3x, the issue says).
    ratio = decode_step(64, 8192) / decode_step(64, 1024)
    assert 1.8 <= ratio <= 3.0
    # Short contexts: the weights dominate, 64 sequences cost far less than 64 steps of one.
    assert decode_step(64, 128) < 1.5 * decode_step(1, 128)
    # The linear fit cannot tell the two apart.
    linear = get_profile(QWEN, "linear")
    assert linear.step_seconds(0, 64, decode_context=64 * 8192) == linear.step_seconds(0, 64)


def test_each_decoding_sequence_costs_its_layers_beyond_its_bytes() -> None:
    # The same KV bytes (64 x 1k = 32 x 2k tokens) and weights: twice the sequences add one
    # per-sequence cost per layer each (and their tokens' share of the all-reduces).
    per_layer = EFFICIENCY.decode_seq_layer_us * 1e-6
    roof = get_profile(QWEN).roofline
    assert roof is not None
    comm = roof.comm_seconds(64) - roof.comm_seconds(32)
    extra = decode_step(64, 1024) - decode_step(32, 2048) - comm
    assert extra == pytest.approx(32 * MODELS["qwen3-32b"].num_layers * per_layer)
    assert extra > 0


def test_scheduler_charges_each_decoding_sequence_its_context() -> None:
    """Through the scheduler: 64 sequences decoding after 1k vs 8k-token prompts (a KV cache
    large enough for both, the step model unchanged)."""

    def itl(prompt_len: int) -> float:
        engine = make_engine(profile=QWEN, num_gpu_blocks=40_000)
        for i in range(64):
            prompt = [1000 + i] + [2000 + (j % 5000) for j in range(prompt_len - 1)]
            add(engine, f"r{i}", prompt, max_tokens=1000, ignore_eos=True)
        sched = engine.scheduler
        while True:
            step = sched.step()
            if step.prefill_tokens == 0:
                assert step.decode_tokens == 64
                assert step.decode_context > 64 * prompt_len
                return step.duration

    ratio = itl(8192) / itl(1024)
    assert 1.8 <= ratio <= 3.0


def test_prefill_chunks_of_a_long_prompt_slow_as_the_context_grows() -> None:
    engine = make_engine(profile="qwen3-32b-2xh100-128k")
    add(engine, "long", list(range(1000, 1000 + 100_000)), max_tokens=1)
    durations, pairs = [], []
    while engine.scheduler.has_work():
        step = engine.scheduler.step()
        if step.prefill_tokens == 8192:  # the full chunks
            durations.append(step.duration)
            pairs.append(step.prefill_pairs)
    assert len(durations) == 100_000 // 8192
    assert durations == sorted(durations) and pairs == sorted(pairs)
    # The 12th chunk attends to ~90k cached tokens; the first only to itself.
    assert durations[-1] > 2.5 * durations[0]
    n = 8192
    assert pairs[1] == n * n + n * (n + 1) // 2


def test_scheduler_reports_the_context_sums_it_charged() -> None:
    engine = make_engine()  # tiny: 64-token budget
    add(engine, "a", list(range(10, 110)), max_tokens=3)  # 100 tokens: chunks of 64 and 36
    first = engine.scheduler.step()
    assert (first.prefill_tokens, first.prefill_context, first.prefill_pairs) == (
        64, 64, 64 * 65 // 2)
    second = engine.scheduler.step()
    assert (second.prefill_context, second.prefill_pairs) == (100, 36 * 64 + 36 * 37 // 2)
    third = engine.scheduler.step()
    assert (third.decode_tokens, third.decode_context, third.prefill_context) == (1, 101, 0)


def test_kv_capacity_follows_from_memory() -> None:
    llama, qwen = get_profile("llama3-8b-h100"), get_profile(QWEN)
    # Within 10 % of the hand-set 29,205 blocks; llm-d's vLLM logged 307,328 tokens per
    # Qwen3-32B TP=2 instance on H100s.
    assert llama.num_gpu_blocks == pytest.approx(29_205, rel=0.10)
    assert qwen.kv_capacity_tokens == pytest.approx(307_328, rel=0.01)
    assert get_profile("qwen3-32b-2xh100-128k").num_gpu_blocks == qwen.num_gpu_blocks
    # vLLM's profiler for Llama-3-8B on one H100 at 0.9 logged 53.29 GiB for the KV cache.
    model = MODELS["llama-3.1-8b"]
    assert llama.kv_capacity_tokens * model.kv_bytes_per_token / GIB == pytest.approx(
        53.29, rel=0.02)
    # Less memory, fewer tokens: 0.1 of 79.22 GiB at 128 KiB per token.
    roof = Roofline(model, GPUS["h100-sxm"], 1, EFFICIENCY)
    kw = {"max_num_batched_tokens": 8192, "max_num_seqs": 1024}
    lost = roof.kv_capacity_tokens(gpu_memory_utilization=0.9, **kw) - roof.kv_capacity_tokens(
        gpu_memory_utilization=0.8, **kw)
    assert lost == pytest.approx(0.1 * 79.22 * GIB / model.kv_bytes_per_token, abs=1)
    # A second GPU halves the weights and the KV bytes per token per GPU: more than twice.
    two = Roofline(model, GPUS["h100-sxm"], 2, EFFICIENCY)
    assert two.kv_capacity_tokens(gpu_memory_utilization=0.9, **kw) > 2 * roof.kv_capacity_tokens(
        gpu_memory_utilization=0.9, **kw)
    # A model that does not fit is an error, not a negative cache.
    big = dataclasses.replace(model, params=80e9)
    with pytest.raises(ValueError, match="does not fit"):
        Roofline(big, GPUS["h100-sxm"], 1, EFFICIENCY).kv_capacity_tokens(
            gpu_memory_utilization=0.9, **kw)


def test_kv_capacity_follows_the_limits_the_engine_is_served_with() -> None:
    qwen = get_profile(QWEN)
    per_token = MODELS["qwen3-32b"].kv_bytes_per_token / 2
    # vLLM divides the same memory into blocks of the size asked for: bigger blocks, fewer.
    big = SimConfig(profile=QWEN, block_size=64).resolved_profile()
    assert big.kv_capacity_tokens == pytest.approx(qwen.kv_capacity_tokens, abs=64)
    # Its profiling pass samples max_num_seqs rows of fp32 logits: fewer rows, more KV.
    few = SimConfig(profile=QWEN, max_num_seqs=64).resolved_profile()
    gained = (1024 - 64) * MODELS["qwen3-32b"].vocab_size * 4 / per_token
    assert few.kv_capacity_tokens - qwen.kv_capacity_tokens == pytest.approx(gained, abs=16)
    smaller_pass = SimConfig(profile=QWEN, max_num_batched_tokens=2048).resolved_profile()
    assert smaller_pass.num_gpu_blocks > qwen.num_gpu_blocks
    # An explicit block count wins, and a profile without a memory model keeps its own.
    pinned = SimConfig(profile=QWEN, block_size=64, num_gpu_blocks=100).resolved_profile()
    assert pinned.num_gpu_blocks == 100
    assert SimConfig(profile="tiny", block_size=32).resolved_profile().num_gpu_blocks == 64


def test_the_linear_option_reproduces_the_old_fit() -> None:
    old = {"llama3-8b-h100": (5753.0, 17.25, 6.0), QWEN: (12_500.0, 38.0, 9.0)}
    for name, (base, prefill, decode) in old.items():
        p = SimConfig(profile=name, step_model="linear").resolved_profile()
        for tokens in ((0, 1), (8192, 0), (3000, 200)):
            expected = (base + prefill * tokens[0] + decode * tokens[1]) * 1e-6
            assert p.step_seconds(*tokens, decode_context=10**6, prefill_pairs=10**9) == expected
    assert PROFILES["tiny"].step_model == "linear"
    with pytest.raises(ValueError, match="no model/GPU config"):
        SimConfig(profile="tiny", step_model="roofline").resolved_profile()
    with pytest.raises(ValueError, match="unknown step model"):
        get_profile(QWEN, "quadratic")


def test_engine_cli_selects_the_step_model() -> None:
    import argparse

    from kvswitch.engine.cli import add_arguments, sim_config_kwargs

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--profile", QWEN, "--step-model", "linear"])
    profile = SimConfig(**sim_config_kwargs(args)).resolved_profile()
    assert (profile.name, profile.step_model) == (QWEN, "linear")
    default = SimConfig(**sim_config_kwargs(parser.parse_args(["--profile", QWEN])))
    assert default.resolved_profile().step_model == "roofline"
    with pytest.raises(SystemExit):
        parser.parse_args(["--step-model", "quadratic"])


async def test_embedding_costs_a_prefill_of_its_input(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from kvswitch.engine.sim import engine as engine_module

    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def record(seconds: float) -> None:
        slept.append(seconds)
        await real_sleep(0)

    engine = make_engine(profile=QWEN)
    monkeypatch.setattr(engine_module.asyncio, "sleep", record)
    n = 8000
    vector = await engine.embed("e", list(range(1000, 1000 + n)))
    assert len(vector) == engine.config.embedding_dim
    p = engine.profile
    expected = p.step_seconds(n, 0, prefill_context=n, prefill_pairs=n * (n + 1) // 2)
    assert expected > p.step_seconds(n, 0)  # the attention over the input is charged
    assert slept == [pytest.approx(expected / engine.config.time_scale)]
