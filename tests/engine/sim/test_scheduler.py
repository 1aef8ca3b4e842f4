"""vLLM V1 scheduling on the tiny profile (64 blocks of 16, 4 seqs, 64-token budget), sans IO."""

from __future__ import annotations

from kvswitch.engine.sim.request import SeqStatus

from .conftest import add, make_engine, run_until_done

PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks + 4


def steps_to_first_token(engine, seqs) -> float:  # type: ignore[no-untyped-def]
    """Simulated seconds from now until the sequence's first output token."""
    elapsed = 0.0
    while seqs[0].num_output_tokens == 0:
        elapsed += engine.scheduler.step().duration
    return elapsed


def test_identical_prompt_hits_the_cache_and_its_ttft_is_shorter() -> None:
    engine = make_engine()
    first = add(engine, "a", PROMPT, max_tokens=4)
    ttft_cold = steps_to_first_token(engine, first)
    run_until_done(engine)
    second = add(engine, "b", PROMPT, max_tokens=4)
    ttft_warm = steps_to_first_token(engine, second)
    assert first[0].num_cached_tokens == 0
    assert second[0].num_cached_tokens == 96  # the 6 full blocks
    assert ttft_warm < ttft_cold
    run_until_done(engine)
    assert engine.scheduler.prefix_hits == 96 and engine.scheduler.prefix_queries == 200


def test_chunked_prefill_respects_the_token_budget() -> None:
    engine = make_engine()
    seqs = add(engine, "a", PROMPT, max_tokens=2)
    chunks = []
    while seqs[0].num_output_tokens == 0:
        r = engine.scheduler.step()
        chunks.append(r.prefill_tokens)
    assert chunks == [64, 36]
    # Two sequences share the budget: running ones first, the rest for newcomers.
    engine2 = make_engine()
    a = add(engine2, "a", [1] * 40, max_tokens=5)
    b = add(engine2, "b", [2] * 40, max_tokens=5)
    r = engine2.scheduler.step()
    assert r.prefill_tokens == 64
    assert (a[0].num_computed_tokens, b[0].num_computed_tokens) == (40, 24)


def test_max_num_seqs_leaves_the_rest_waiting() -> None:
    engine = make_engine()
    seqs = [add(engine, f"r{i}", [i + 1] * 8, max_tokens=3)[0] for i in range(6)]
    engine.scheduler.step()
    assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 2
    assert [s.status for s in seqs[4:]] == [SeqStatus.WAITING] * 2
    assert engine.load().waiting == 2 and engine.load().running == 4
    assert engine.load().waiting_uncached_tokens == 16
    run_until_done(engine)
    assert all(s.finish_reason == "length" and s.num_output_tokens == 3 for s in seqs)


def test_preemption_under_kv_pressure_and_everyone_completes() -> None:
    engine = make_engine()
    # 4 x (100 prompt + 300 output) tokens = 4 x 25 blocks > 64 blocks.
    seqs = [add(engine, f"r{i}", [i + 1] + PROMPT[1:], max_tokens=300)[0] for i in range(4)]
    run_until_done(engine)
    assert engine.scheduler.preemptions > 0
    assert any(s.num_preemptions for s in seqs)
    for i, s in enumerate(seqs):
        assert s.finish_reason == "length"
        # Recompute after preemption neither loses nor repeats tokens: echo is positional.
        echo = [i + 1] + PROMPT[1:]
        assert s.token_ids[100:] == [echo[k % 100] for k in range(300)]
    assert engine.kv.pool.num_used == 0


def test_preempted_sequence_goes_to_the_front_of_the_queue() -> None:
    engine = make_engine(max_num_seqs=8)
    running = [add(engine, f"r{i}", [i + 1] * 200, max_tokens=400)[0] for i in range(4)]
    late = add(engine, "late", [99] * 20, max_tokens=1)[0]
    while not engine.scheduler.preemptions:
        engine.scheduler.step()
    victim = engine.scheduler.waiting[0]
    assert victim in running and victim.status is SeqStatus.PREEMPTED
    assert victim.num_computed_tokens == 0 and victim.blocks == []
    assert late.status is SeqStatus.WAITING or late.finished


def test_decode_steps_cost_the_profile_model() -> None:
    engine = make_engine()
    add(engine, "a", [5] * 10, max_tokens=3)
    add(engine, "b", [6] * 10, max_tokens=3)
    durations = run_until_done(engine)
    p = engine.profile
    assert durations[0] == p.step_seconds(20, 0)
    assert durations[1:] == [p.step_seconds(0, 2)] * 2


def test_abort_frees_blocks_at_once() -> None:
    engine = make_engine()
    seqs = add(engine, "a", PROMPT, max_tokens=50)
    engine.scheduler.step()
    assert engine.kv.pool.num_used > 0
    assert engine.scheduler.abort(seqs[0]) is True
    assert engine.kv.pool.num_used == 0 and not engine.scheduler.has_work()
    assert seqs[0].finish_reason == "abort"
    assert engine.scheduler.abort(seqs[0]) is False


def test_kv_pressure_preempts_the_newest_running_sequence_only_when_a_block_is_missing() -> None:
    # vLLM V1: a running sequence that cannot get its next block preempts the last admitted one.
    engine = make_engine()
    seqs = [add(engine, f"r{i}", [i + 1] * 200, max_tokens=200)[0] for i in range(4)]
    free_before = []
    while not engine.scheduler.preemptions:
        free_before.append(engine.kv.pool.num_free)
        engine.scheduler.step()
    assert free_before[-1] == 0  # nobody was preempted while a block was free
    assert engine.scheduler.waiting[0] is seqs[3]
    assert [s.status for s in seqs[:3]] == [SeqStatus.RUNNING] * 3


def test_sequences_are_admitted_without_reserving_their_whole_length() -> None:
    # 2 x (100 prompt + 540 output) tokens need 80 blocks in the end; the cache has 64, and
    # vLLM admits both anyway (it allocates blocks as tokens arrive).
    engine = make_engine()
    a = add(engine, "a", [1] + PROMPT[1:], max_tokens=540)[0]
    b = add(engine, "b", [2] + PROMPT[1:], max_tokens=540)[0]
    for _ in range(4):
        engine.scheduler.step()
    assert a.status is SeqStatus.RUNNING and b.status is SeqStatus.RUNNING
    # Each holds the blocks of the tokens it has, not of the 640 it will have.
    assert [len(s.blocks) for s in (a, b)] == [-(-len(s.token_ids) // 16) for s in (a, b)]
    assert engine.kv.pool.num_used < 20


def test_free_blocks_holding_cached_prefixes_count_as_free() -> None:
    engine = make_engine()
    # Four finished requests leave 4 x 12 cached blocks, all free (reference count 0).
    for i in range(4):
        add(engine, f"old{i}", [50 + i] * 190, max_tokens=2)
    run_until_done(engine)
    assert engine.kv.pool.num_free == 64 and len(engine.kv.pool.cached) >= 44
    # A new prompt needing 60 blocks evicts them instead of waiting.
    new = add(engine, "new", [7] * 950, max_tokens=2)[0]
    engine.scheduler.step()
    assert new.status is SeqStatus.RUNNING and engine.scheduler.preemptions == 0
